"""The routing decision in Python: the reference model the native one (native/radix/decide.cpp)
is driven beside (tests/router/test_decide_native.py). It is the Python code the native one
replaced, kept only here: the prompt_tree and cost rules, the cost model's plans and prefix
heat, reading the same workers and the same prompt trees through their Python views."""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.policies import (
    CostModel,
    Decision,
    RouteRequest,
    Thresholds,
    pull_limit,
    reusable,
)
from router.speed import Work
from router.trees import PrefixView, PromptTrees
from router.workers import Worker, WorkerType

DRAWN_HALF_LIFE_S = 60.0  # decide.hpp: kDrawnHalfLifeS
FRESH_BAND = 2.0  # decide.hpp: kFreshBand
FRESH_SPEED_BAND = 2.5  # decide.hpp: kFreshSpeedBand


class PrefixHeat:
    """Decayed counts of requests per prefix, keyed by its length and last page."""

    def __init__(
        self,
        page_size: int,
        half_life_s: float = 30.0,
        max_entries: int = 1 << 14,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.page_size = page_size
        self.rate = math.log(2) / half_life_s
        self.max_entries = max_entries
        self.clock = clock
        self._counts: OrderedDict[tuple[int, bytes], tuple[float, float]] = OrderedDict()
        self.before = 0.0
        self._total, self._total_at = 0.0, clock()

    def share(self, heat: float) -> float:
        return heat / self.before if self.before > 0 else 0.0

    def bump(self, tokens: Sequence[int], length: int) -> float:
        now = self.clock()
        self.before = self._total * math.exp(-self.rate * (now - self._total_at))
        self._total, self._total_at = self.before + 1.0, now
        if length < self.page_size:
            return 0.0
        key = (length, array("I", tokens[length - self.page_size : length]).tobytes())
        count, at = self._counts.pop(key, (0.0, now))
        count *= math.exp(-self.rate * (now - at))
        self._counts[key] = (count + 1.0, now)
        if len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        return count


@dataclass(slots=True)
class Plan:
    seconds: float
    computed: int
    pull: bool = False
    work: Work | None = None


def _queue(c: CostModel, worker: Worker, host: int, load: int) -> tuple[float, float]:
    work = worker.queued_tokens * c.prefill_s_per_token + load * c.busy_s_per_request
    modelled = work * worker.speed.queue_x + worker.in_flight_fixed_s
    if worker.type is not WorkerType.PREFILL and worker.waiting:
        modelled = max(modelled, worker.measured_wait_s())
    return modelled + host * c.host_load_s_per_token, work


def _terms(c: CostModel, new: int, cached: int) -> tuple[float, float]:
    return new * c.prefill_s_per_token, new * (cached + new / 2) * c.prefill_s_per_token_pair


def plan(
    c: CostModel,
    worker: Worker,
    tokens: int,
    cached: int,
    host: int,
    source: Worker | None,
    best: int,
    load: int,
) -> Plan:
    queue, work = _queue(c, worker, host, load)
    speed = worker.speed
    loading = host * c.host_load_s_per_token + worker.in_flight_fixed_s
    tokens_s, pairs_s = _terms(c, tokens - cached, cached)
    own = Plan(
        queue + speed.prefill_s(tokens_s, pairs_s),
        tokens - cached,
        False,
        Work(work, tokens_s, pairs_s, fixed_s=loading),
    )
    if source is None or best <= cached or not worker.can_pull:
        return own
    moved = (best - cached) * c.transfer_s_per_token * (1 + source.pulls_served)
    tokens_s, pairs_s = _terms(c, tokens - best, best)
    pull = queue + moved * speed.transfer_x + speed.prefill_s(tokens_s, pairs_s)
    if pull >= own.seconds:
        return own
    return Plan(pull, tokens - best, True, Work(work, tokens_s, pairs_s, moved, loading))


@dataclass(slots=True)
class Options:
    workers: list[Worker]
    view: PrefixView
    held: dict[str, int]
    plans: dict[str, Plan]
    best: Worker
    loads: dict[str, int]
    before: dict[str, float]  # an adapter's load or wait, paid before the prefill
    pullable: int  # of the longest prefix, what a pull may cover
    # of `before`, an adapter's load the engine runs for it (the requests behind it wait too)
    load_s: dict[str, float]


class ReferencePolicy:
    """`rule` prompt_tree or cost, as the Python policies decided before the native core."""

    def __init__(
        self,
        rule: str,
        trees: PromptTrees,
        thresholds: Thresholds,
        cost: CostModel,
        pulls: bool = True,
        heat: PrefixHeat | None = None,
    ) -> None:
        self.rule = rule
        self.trees, self.thresholds, self.cost, self.pulls = trees, thresholds, cost, pulls
        self.heat = heat or PrefixHeat(trees.page_size)
        self.drawn: dict[str, tuple[float, float]] = {}  # url: (tokens, at), on the heat's clock

    def _drawn_tokens(self, url: str, now: float) -> float:
        """The tokens a worker was sent to compute, decayed to `now`."""
        tokens, at = self.drawn.get(url, (0.0, 0.0))
        return tokens * 2.0 ** (-max(now - at, 0.0) / DRAWN_HALF_LIFE_S)

    def _drawn(self, worker: Worker, now: float) -> float:
        """The work a worker drew lately: its decayed tokens at its speed."""
        return self._drawn_tokens(worker.url, now) * worker.speed.token_x

    def _options(self, request: RouteRequest, workers: list[Worker]) -> Options:
        n, page = request.num_tokens, self.trees.page_size
        view = self.trees.match(request.type, request.tree_key(request.tokens or (), page))
        held = {w.url: reusable(view.held.get(w.url, 0), n, page) for w in workers}
        loads = {w.url: w.load for w in workers}
        best, best_key = workers[0], (held[workers[0].url], -loads[workers[0].url])
        for w in workers[1:]:
            if (held[w.url], -loads[w.url]) > best_key:
                best, best_key = w, (held[w.url], -loads[w.url])
        most = held[best.url]
        limit = pull_limit(request.namespace, page)
        pullable = most if limit < 0 else min(most, limit)
        source = best if self.pulls and pullable and best.agent is not None else None
        plans = {
            w.url: plan(
                self.cost,
                w,
                n,
                held[w.url],
                min(view.host(w.url), held[w.url]),
                source if source is not w else None,
                pullable,
                loads[w.url],
            )
            for w in workers
        }
        adapter = request.namespace.lora_name if request.namespace is not None else None
        before = {w.url: 0.0 for w in workers}
        loading = {w.url: 0.0 for w in workers}
        if adapter is not None:  # an adapter to load first, where it is not in memory
            lora_s = self.cost.lora_load_s
            for w in workers:
                p, load_s = plans[w.url], w.adapters.seconds(adapter, lora_s)
                assert p.work is not None
                p.seconds += load_s
                # the speed fit's fixed part: what this request waits for, not the evicted
                # adapter's next load
                p.work = p.work._replace(
                    fixed_s=p.work.fixed_s + w.adapters.paid_s(adapter, lora_s)
                )
                before[w.url] = load_s
                loading[w.url] = w.adapters.stall_s(adapter, lora_s)
        return Options(workers, view, held, plans, best, loads, before, pullable, loading)

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        o = self._options(request, workers)
        if self.rule == "cost":
            choice = min(workers, key=lambda w: (o.plans[w.url].seconds, o.loads[w.url]))
            return self._decide(o, choice, "cache_hit" if o.held[choice.url] else "cache_miss")
        held, plans, loads = o.held, o.plans, o.loads
        n, page = request.num_tokens, self.trees.page_size
        home = o.view.home
        if home:
            affinity = {
                url: max(mine, reusable(home[url], n, page)) if url in home else mine
                for url, mine in held.items()
            }
            best = max(workers, key=lambda w: (affinity[w.url], held[w.url], -loads[w.url]))
        else:
            affinity, best = held, o.best
        most = affinity[best.url]
        heat = self.heat.bump(request.tree_key(request.tokens or (), page), most)
        if heat:
            copies = sum(a >= most for a in affinity.values())
            if copies >= self.heat.share(heat) * len(workers):
                heat = 0.0
        placement: dict[str, float] = {}
        for w in workers:
            lacks = most - affinity[w.url]
            seconds = plans[w.url].seconds
            free = w.state.free_tokens
            if lacks and (free < lacks or loads[w.url] or w.waiting):  # idle, room: no charge
                per_token = self.cost.prefill_s_per_token
                # the copy's part past the free KV evicts: no heat
                evicts = 0 if free < 0 else min(max(lacks - free, 0), lacks)
                paid = evicts + (lacks - evicts) / (1 + heat)
                seconds += paid * per_token * w.speed.token_x * (1 + w.waiting)
            seconds += o.load_s[w.url] * w.waiting  # the load holds up those waiting there
            own = (n - min(most, n)) * self.cost.prefill_s_per_token * w.speed.token_x
            seconds += own * max(w.waiting - 1, 0)  # in the step of those queued there
            placement[w.url] = seconds
        soonest = min(workers, key=lambda w: (placement[w.url], loads[w.url]))
        if most == 0:  # a new prefix: near the soonest start, the fewest waiting, the least drawn
            now, latest = self.heat.clock(), placement[soonest.url] * FRESH_BAND
            near = [w for w in workers if placement[w.url] <= latest]
            fastest = min(w.speed.token_x for w in near)
            near = [w for w in near if w.speed.token_x <= fastest * FRESH_SPEED_BAND]
            fresh = min(near, key=lambda w: (w.waiting, self._drawn(w, now), loads[w.url]))
            return self._draw(self._decide(o, fresh, "cache_miss"), o)
        low = min(loads.values())
        if self.thresholds.imbalanced(loads[best.url], low):
            lightest = min(
                (w for w in workers if loads[w.url] == low), key=lambda w: placement[w.url]
            )
            return self._draw(self._decide(o, lightest, "overload"), o)
        if soonest is not best and placement[soonest.url] < placement[best.url]:
            if held[soonest.url] >= most:
                return self._draw(self._decide(o, soonest, "cache_hit"), o)
            reason = "overload" if held[best.url] else "home_busy"
            return self._draw(self._decide(o, soonest, reason), o)
        return self._draw(self._decide(o, best, "cache_hit" if held[best.url] else "home"), o)

    def _draw(self, decision: Decision, o: Options) -> Decision:
        """Note the prompt tokens the chosen worker computes, as drawn work."""
        now, url = self.heat.clock(), decision.worker.url
        self.drawn[url] = (self._drawn_tokens(url, now) + o.plans[url].computed, now)
        return decision

    def _decide(self, o: Options, choice: Worker, reason: str) -> Decision:
        mine = o.held[choice.url]
        p = o.plans[choice.url]
        if p.pull:
            reason = "pull" if reason in ("cache_hit", "cache_miss") else reason + "_pull"
        elif reason == "cache_hit" and o.view.host(choice.url):
            reason = "host_hit"
        holders: list[tuple[Worker, int]] = []
        if self.pulls and choice.can_pull and o.pullable > mine:
            longer = (
                (w, o.held[w.url])
                for w in o.workers
                if w is not choice and w.agent is not None and o.held[w.url] > mine
            )
            holders = sorted(longer, key=lambda x: -x[1])
        pull_from = o.best if p.pull else None
        return Decision(choice, mine, holders, reason, pull_from, p.work, o.load_s[choice.url])
