"""Routing policies, named as sglang-router names them (hyphenated spellings accepted too).

`prompt_tree` is MemServe's: the instance holding the longest cached token prefix, unless it
is overloaded relative to the others, in which case the request goes where its expected
time to first token is lowest. `cost` always decides by expected TTFT (Mooncake's
conductor): queued prefill work plus the uncached part, or a pull of a longer prefix from
the instance that holds it. Both name the holders of longer prefixes, so a MemPool-backed
worker can pull them. `cache_aware` is sglang-router's rule on a character tree, kept for
comparison.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mempool.radix import RadixTree
from router.heat import PrefixHeat
from router.speed import Work
from router.trees import PrefixView, PromptTrees
from router.workers import Worker, WorkerType


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at."""

    tokens: Sequence[int] | None  # uint32 array from the router
    text: str
    session: str | None
    type: WorkerType = WorkerType.COLOCATED
    chat: list[dict[str, Any]] | None = None  # a chat's messages (the router's, not policies')
    # Text the router has never encoded, left for after the dispatch (it cannot be on any
    # tree path): its pieces, and about how many tokens it holds.
    rest: list[str] | None = None
    rest_tokens: int = 0
    # the last `guessed` of `tokens` are likely ids of rest's start, not exact ones
    # (router.request: the policies match them; only exact ids are recorded)
    guessed: int = 0
    encoding: asyncio.Task[None] | None = None  # `rest` being encoded on a thread (router.request)
    # the trees told at dispatch that a worker is about to hold the prompt: (tree, URL,
    # time.monotonic() then) (router.forward.dispatch; learning skips a record that adds nothing)
    recorded: list[tuple[WorkerType, str, float]] | None = None

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens (the part not yet encoded estimated)."""
        return len(self.tokens or ()) + self.rest_tokens


def reusable(held: int, n: int, page: int) -> int:
    """Tokens of an `n`-token prompt an engine holding `held` of it reuses: whole pages only,
    and never the last prompt token, which it always computes."""
    return min(held, n - 1) // page * page


@dataclass(slots=True)
class Decision:
    worker: Worker
    predicted_cached: int = 0  # tokens the trees believe the worker holds and will reuse
    # Workers holding a longer prefix, longest first, with how much: named in the request
    # when the chosen worker pulls (MemPool), so it can pull instead of recomputing.
    holders: list[tuple[Worker, int]] = field(default_factory=list)
    reason: str = "policy"
    pull_from: Worker | None = None  # the holder the plan pulls from, if it pulls
    # the work ahead of its first token at the cost model's constants, by term (Plan.work;
    # None: the policy has no cost model): the worker's speed is fitted to its measured time
    work: Work | None = None


@dataclass(slots=True)
class Thresholds:
    """sglang-router's --cache-threshold, --balance-abs-threshold, --balance-rel-threshold."""

    cache: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5

    def imbalanced(self, high: int, low: int) -> bool:
        return high - low > self.balance_abs and high > low * self.balance_rel


@dataclass(slots=True)
class Plan:
    """How one worker would serve a request, and when its first token is expected."""

    seconds: float
    computed: int  # prompt tokens it would compute
    pull: bool = False  # it pulls the longer prefix instead of computing it
    # `seconds`' terms at the constants, before the worker's speed (router.speed) scales them
    work: Work | None = None


@dataclass(slots=True)
class Options:
    """What each candidate worker holds of a prompt and how it would serve it."""

    workers: list[Worker]
    view: PrefixView
    held: dict[str, int]  # predicted reusable tokens per worker (any tier)
    plans: dict[str, Plan]
    best: Worker  # the holder of the longest prefix
    loads: dict[str, int]  # each worker's load (Worker.load), read once


@dataclass(slots=True)
class CostModel:
    """Expected TTFT terms; defaults are the sim's H100 Llama-3.1-8B figures, scaled per
    worker by its learned speed (`Worker.speed`, router.speed): its queue, per-token and
    attention coefficients over these constants, and the overhead every request pays."""

    prefill_s_per_token: float = 4.0e-5
    transfer_s_per_token: float = 5.2e-6  # 128 KiB per token over a 25 GB/s link
    # Requests already running share every engine step with a new prefill: a decode step
    # (6.8 ms) shared by a typical batch puts roughly this much in front of it per request.
    busy_s_per_request: float = 2.0e-3
    host_load_s_per_token: float = 2.6e-6  # 128 KiB per token host -> GPU over 50 GB/s PCIe
    # Attention: each new token attends to the context before it (0.52 MFLOP a pair).
    prefill_s_per_token_pair: float = 1.3e-9

    def prefill_s(self, new: int, cached: int) -> float:
        """Computing `new` prompt tokens after `cached` reused ones, at the constants."""
        tokens_s, pairs_s = self.prefill_terms(new, cached)
        return tokens_s + pairs_s

    def prefill_terms(self, new: int, cached: int) -> tuple[float, float]:
        """`prefill_s`'s per-token and attention parts (learned apart: router.speed)."""
        return new * self.prefill_s_per_token, new * (cached + new / 2) * (
            self.prefill_s_per_token_pair
        )

    def queue_s(self, worker: Worker, host: int = 0, load: int | None = None) -> float:
        """Seconds before a new prefill starts on `worker`: its queued prefill tokens and
        running requests, or, when longer, the wait measured from the requests waiting there
        and the rate it serves them at (requests waiting for memory or a batch slot); then
        `host` tokens of the request's own prefix to load from its host tier. With `host=0`
        it is the worker's expected wait, the same for any request (admission by expected
        wait uses it: router.admission). `load`: `worker.load` when the caller read it.

        A PD prefill's is the model alone: every request sent there is counted, with the
        tokens it computes, until the prefill answers at the end of its prefill, so the model
        sees the whole queue and each request's size; the measurement would count the running
        prefill as waiting and weigh a 100-token suffix as much as a cold 10K-token prompt
        (docs/benchmarks/hot-prefix.md: what dropping it changed on 2P2D)."""
        return self._queue(worker, host, load)[0]

    def _queue(self, worker: Worker, host: int, load: int | None) -> tuple[float, float]:
        """(queue_s, its modelled part at the constants, before the worker's speed)."""
        work = worker.queued_tokens * self.prefill_s_per_token
        work += (worker.load if load is None else load) * self.busy_s_per_request
        modelled = work * worker.speed.queue_x
        if worker.type is not WorkerType.PREFILL and worker.waiting:  # else measured: 0
            modelled = max(modelled, worker.measured_wait_s())
        return modelled + host * self.host_load_s_per_token, work

    def plan(
        self,
        worker: Worker,
        tokens: int,
        cached: int,
        host: int = 0,
        source: Worker | None = None,
        best: int = 0,
        load: int | None = None,
    ) -> Plan:
        """`worker` holds `cached` tokens of the prompt (`host` of them in host memory, to
        load first); `source`, when given, holds `best` and may be pulled from: the pull
        shares the source's link with the pulls already planned from it. `load`: as for
        queue_s."""
        queue, work = self._queue(worker, host, load)
        speed = worker.speed
        loading = host * self.host_load_s_per_token
        tokens_s, pairs_s = self.prefill_terms(tokens - cached, cached)
        own = Plan(
            queue + speed.prefill_s(tokens_s, pairs_s),
            tokens - cached,
            False,
            Work(work, tokens_s, pairs_s, loading),
        )
        if source is None or best <= cached or not worker.can_pull:
            return own
        moved = (best - cached) * self.transfer_s_per_token * (1 + source.pulls_served)
        tokens_s, pairs_s = self.prefill_terms(tokens - best, best)
        pull = queue + moved + speed.prefill_s(tokens_s, pairs_s)
        if pull >= own.seconds:
            return own
        return Plan(pull, tokens - best, True, Work(work, tokens_s, pairs_s, loading + moved))


def least_loaded(workers: list[Worker]) -> Worker:
    low = min(w.load for w in workers)
    return random.choice([w for w in workers if w.load == low])


class Policy(ABC):
    name: str
    uses_tokens = False  # the router tokenizes prompts for this policy
    uses_text = False  # the router joins the prompt's raw text for this policy

    @abstractmethod
    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        """Pick one of `workers` (never empty)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker)


class Random(Policy):
    name = "random"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        return Decision(random.choice(workers))


class LeastLoad(Policy):
    name = "least_load"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        return Decision(least_loaded(workers))


class PowerOfTwo(Policy):
    name = "power_of_two"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        pair = random.sample(workers, min(2, len(workers)))
        return Decision(min(pair, key=lambda w: w.load))


class Session(Policy):
    """Sticky by session key (rendezvous hashing, stable as workers come and go)."""

    name = "session"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        if request.session is None:
            return Decision(least_loaded(workers), reason="no_session")

        def score(w: Worker) -> bytes:
            return hashlib.blake2b(f"{request.session}|{w.url}".encode(), digest_size=8).digest()

        return Decision(max(workers, key=score), reason="session")


class CacheAware(Policy):
    """sglang-router's cache_aware: a character radix tree, tenants are workers."""

    name = "cache_aware"
    uses_text = True

    def __init__(self, thresholds: Thresholds, max_chars: int = 1 << 24) -> None:
        self.thresholds = thresholds
        self.max_chars = max_chars
        self.tree = RadixTree(page_size=1, slots_per_page=0)

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        chars = [ord(c) for c in request.text] or [0]
        loads = [w.load for w in workers]
        if self.thresholds.imbalanced(max(loads), min(loads)):
            choice, reason = least_loaded(workers), "balance"
        else:
            held = self.tree.match(chars).holder_tokens
            urls = {w.url: w for w in workers}
            best = max((u for u in held if u in urls), key=held.__getitem__, default=None)
            if best is not None and held[best] / len(chars) > self.thresholds.cache:
                choice, reason = urls[best], "cache_hit"
            else:
                choice, reason = least_loaded(workers), "cache_miss"
        self.tree.insert(chars, holder=choice.url)
        if self.tree.num_pages > self.max_chars:
            self.tree.evict(self.tree.num_pages - self.max_chars * 9 // 10)
        return Decision(choice, reason=reason)


class PromptTree(Policy):
    """MemServe: longest cached token prefix, guarded against overload.

    The holder of the longest prefix (in its GPU memory or its host tier) wins unless another
    worker is expected to start the request sooner (Mooncake's TTFT estimate: queued work,
    loading host-tier pages, and the uncached prefill, or a MemPool pull of the longer
    prefix) by more than the recomputed prefix costs the requests queued behind it, or
    unless loads are imbalanced by sglang-router's thresholds. Without the estimate a prefix
    every request shares (a system prompt, a trace's first block) would pull all traffic to
    whichever worker saw it first. When work does move off an overloaded holder, a worker
    that pulls the prefix starts sooner and leaves the GPU free of the recompute.
    """

    name = "prompt_tree"
    uses_tokens = True

    def __init__(
        self, trees: PromptTrees, thresholds: Thresholds, cost: CostModel, pulls: bool = True
    ) -> None:
        self.trees = trees
        self.thresholds = thresholds
        self.cost = cost
        self.pulls = pulls  # plan MemPool pulls between workers that support them
        self.heat = PrefixHeat(trees.page_size)

    def _options(self, request: RouteRequest, workers: list[Worker]) -> Options:
        """What each worker holds, how it would serve the request, and the best holder."""
        # One pass per worker, no key functions: this runs for every request (same
        # decisions as sorting by (held, -load) with the first of equals kept).
        n, page = request.num_tokens, self.trees.page_size
        view = self.trees.match(request.type, request.tokens or ())
        found = view.held
        last = n - 1  # the last prompt token is always computed
        held: dict[str, int] = {}
        loads: dict[str, int] = {}
        best, best_key = workers[0], (0, 0)
        for i, w in enumerate(workers):
            url = w.url
            mine = found.get(url, 0)
            mine = (mine if mine < last else last) // page * page  # reusable()
            held[url] = mine
            load = loads[url] = w.load
            if i == 0 or (mine, -load) > best_key:
                best, best_key = w, (mine, -load)
        most = held[best.url]
        source = best if self.pulls and most and best.agent is not None else None
        plans = {}
        plan = self.cost.plan
        for w in workers:
            url = w.url
            mine = held[url]
            host = min(view.host(url), mine)
            pull_from = source if source is not w else None
            plans[url] = plan(w, n, mine, host, pull_from, most, loads[url])
        return Options(workers, view, held, plans, best, loads)

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        o = self._options(request, workers)
        held, plans, loads = o.held, o.plans, o.loads
        n, page = request.num_tokens, self.trees.page_size
        # Where the prefix lives, or lived last: a prefix evicted everywhere is computed
        # again where it lived rather than scattered (see router.trees: homes).
        home = o.view.home
        if home:
            affinity = {
                url: max(mine, reusable(home[url], n, page)) if url in home else mine
                for url, mine in held.items()
            }
            best = max(workers, key=lambda w: (affinity[w.url], held[w.url], -loads[w.url]))
        else:  # affinity is what each holds, and the best is the best holder
            affinity, best = held, o.best
        most = affinity[best.url]
        per_token = self.cost.prefill_s_per_token
        # Expected TTFT on each worker, plus the prefix it lacks, paid once more:
        # recomputed, that work delays every request queued behind it; pulled, the copy
        # displaces as much of other requests' cache there (caches are full when it matters),
        # which they recompute later. So leaving a holder must win by more than this request's
        # own TTFT, pull or not: pulls make a move cheaper for the request that moves, not
        # more frequent (measured: scoring pulls as free moved 42% of multi-round QA turns off
        # their holders and halved the host-tier hits).
        # Recomputed on a worker with requests waiting, the prefix delays each of them; a
        # prefix many requests reuse pays for its copy on every one of them, while it has
        # fewer copies than its share of the traffic needs workers (router.heat).
        heat = self.heat.bump(request.tokens or (), most)
        if heat:  # counted only for a hot prefix (most requests on a cold one)
            copies = sum(a >= most for a in affinity.values())
            if copies >= self.heat.share(heat) * len(workers):
                heat = 0.0  # copies enough: one more only displaces other prefixes' cache
        placement: dict[str, float] = {}
        soonest, soonest_key = workers[0], (0.0, 0)
        for i, w in enumerate(workers):
            url = w.url
            lacks = most - affinity[url]
            seconds = plans[url].seconds
            if lacks:
                seconds += lacks * per_token * w.speed.token_x * (1 + w.waiting) / (1 + heat)
            placement[url] = seconds
            if i == 0 or (seconds, loads[url]) < soonest_key:
                soonest, soonest_key = w, (seconds, loads[url])
        if most == 0:
            return self._decide(o, soonest, "cache_miss")
        low = min(loads.values())
        if self.thresholds.imbalanced(loads[best.url], low):  # sglang-router's rule: the lightest
            lightest = min(
                (w for w in workers if loads[w.url] == low), key=lambda w: placement[w.url]
            )
            return self._decide(o, lightest, "overload")
        if soonest is not best and placement[soonest.url] < placement[best.url]:
            # to another holder of as much; off a busy holder; or, nothing being held
            # anywhere, off the prefix's busy home
            if held[soonest.url] >= most:
                return self._decide(o, soonest, "cache_hit")
            return self._decide(o, soonest, "overload" if held[best.url] else "home_busy")
        return self._decide(o, best, "cache_hit" if held[best.url] else "home")

    def _decide(self, o: Options, choice: Worker, reason: str) -> Decision:
        """The decision for `choice`; the reason says how its prefix comes (`pull` or
        `..._pull` when it pulls it, `host_hit` when part of it loads from its host tier)."""
        mine = o.held[choice.url]
        plan = o.plans[choice.url]
        if plan.pull:
            reason = "pull" if reason in ("cache_hit", "cache_miss") else reason + "_pull"
        elif reason == "cache_hit" and o.view.host(choice.url):
            reason = "host_hit"
        holders: list[tuple[Worker, int]] = []
        if self.pulls and choice.can_pull:
            longer = (
                (w, o.held[w.url])
                for w in o.workers
                if w is not choice and w.agent is not None and o.held[w.url] > mine
            )
            holders = sorted(longer, key=lambda x: -x[1])
        pull_from = o.best if plan.pull else None
        return Decision(choice, mine, holders, reason, pull_from, plan.work)


class Cost(PromptTree):
    """Mooncake-style: the lowest expected TTFT, counting a pull of a longer prefix."""

    name = "cost"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        o = self._options(request, workers)
        choice = min(workers, key=lambda w: (o.plans[w.url].seconds, o.loads[w.url]))
        return self._decide(o, choice, "cache_hit" if o.held[choice.url] else "cache_miss")


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (RoundRobin, Random, LeastLoad, PowerOfTwo, Session, CacheAware, PromptTree, Cost)
}


def policy_name(name: str) -> str:
    """`prompt-tree` and `prompt_tree` are the same policy; ValueError for unknown names."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return canonical


def make_policy(
    name: str, trees: PromptTrees, thresholds: Thresholds, cost: CostModel, pulls: bool = True
) -> Policy:
    """The policy named `name` (either spelling); ValueError for unknown names. `pulls`: the
    prefix-tree policies may plan MemPool pulls between workers that support them."""
    canonical = policy_name(name)
    if canonical == CacheAware.name:
        return CacheAware(thresholds)
    if canonical == PromptTree.name:
        return PromptTree(trees, thresholds, cost, pulls)
    if canonical == Cost.name:
        return Cost(trees, thresholds, cost, pulls)
    return POLICIES[canonical]()
