"""Routing policies, named as sglang-router names them (hyphenated spellings accepted too).

`prompt_tree` is MemServe's: the instance holding the longest cached token prefix, unless it
is overloaded relative to the others, in which case the request goes where its expected
time to first token is lowest. `cost` always decides by expected TTFT (Mooncake's
conductor): queued prefill work plus the uncached part, or a pull of a longer prefix from
the instance that holds it. Both name the holders of longer prefixes, so a MemPool-backed
worker can pull them. `cache_aware` is sglang-router's rule on a character tree, kept for
comparison.

`prompt_tree` and `cost` decide in one native call (native/radix/decide.cpp: the tree walk
for every candidate, the cost model, the heat and the rule); the classes here hand it the
prompt and the workers' native figures and wrap its answer in a Decision.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mempool._radix import Decider, Heat
from mempool.radix import RadixTree
from router.speed import Work
from router.trees import PromptTrees
from router.workers import Worker, WorkerRegistry, WorkerType
from shared.namespaces import CacheNamespace
from shared.token_cache import CachedEncoder


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
    # the cache namespace its body names (cache_salt, extra_key, an adapter): what the trees
    # predict for it is keyed in it, as the worker keys its cache (shared.namespaces)
    namespace: CacheNamespace | None = None
    tenant: str | None = None  # its API key's tenant (router.tenants; "" the operator's)
    # router.models: the model whose workers may serve it (None: any, when the router serves
    # one), and that model's encoder where it is not the router's default one
    model: str | None = None
    encoder: CachedEncoder | None = None
    # charges its tenant the tokens it computes (fair admission, router.tenants.fair), and
    # what it has been charged so far (a retry or the worker's report charges the difference)
    charge: Callable[[float], None] | None = None
    charged: float = 0.0

    def charge_computed(self, tokens: float) -> None:
        """Its tenant charged `tokens` computed in all (expected at the decision, then as the
        worker reported them)."""
        if self.charge is not None:
            self.charge(tokens - self.charged)
            self.charged = tokens

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter it names (None: the base model)."""
        return self.namespace.lora_name if self.namespace is not None else None

    def tree_key(self, tokens: Sequence[int], page: int) -> Sequence[int]:
        """`tokens` (this prompt's, or its prefix plus an answer) as the trees key them:
        in a namespace, its first page there replaced by ids derived from it, so that no
        prefix is predicted across namespaces (none is shared by the workers either)."""
        if self.namespace is None:
            return tokens
        key = array("I", tokens)
        for start, ids in self.namespace.derived(tokens, page):
            key[start : start + page] = array("I", ids)
        return key

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens (the part not yet encoded estimated)."""
        return len(self.tokens or ()) + self.rest_tokens


def reusable(held: int, n: int, page: int) -> int:
    """Tokens of an `n`-token prompt an engine holding `held` of it reuses: whole pages only,
    and never the last prompt token, which it always computes (none of a prompt whose tokens
    are not counted yet: a text still being encoded)."""
    return max(min(held, n - 1), 0) // page * page


# The reason of a decision made among the idle workers only, while requests waited for a
# slot in the router's queue (WorkerRegistry.idle_first).
IDLE = "idle"


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
    # an adapter's load it waits for before its prefill (router.adapters): the engine loads
    # it in the step that prefills it, so the requests queued behind it wait as long
    load_s: float = 0.0

    @property
    def planned_pull(self) -> int:
        """Prompt tokens the plan pulls from a holder rather than computing (0: no pull)."""
        if self.pull_from is None or not self.holders:
            return 0
        return max(self.holders[0][1] - self.predicted_cached, 0)


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


@dataclass(slots=True, frozen=True)
class CostModel:
    """Expected TTFT terms; defaults are the sim's H100 Llama-3.1-8B figures, scaled per
    worker by its learned speed (`Worker.speed`, router.speed): its queue, per-token and
    attention coefficients over these constants, and the overhead every request pays.

    The arithmetic is native (native/radix/decide.cpp, one implementation): a worker's plan
    is its queue, then its own prefill of the tokens it lacks (`prefill_s_per_token` each and
    `prefill_s_per_token_pair` per attention pair, scaled by its speed), or a MemPool pull of a
    longer prefix (`transfer_s_per_token`, shared with the pulls already planned from the
    holder) and the prefill of the rest, whichever starts its first token sooner."""

    prefill_s_per_token: float = 4.0e-5
    transfer_s_per_token: float = 5.2e-6  # 128 KiB per token over a 25 GB/s link
    # Requests already running share every engine step with a new prefill: a decode step
    # (6.8 ms) shared by a typical batch puts roughly this much in front of it per request.
    busy_s_per_request: float = 2.0e-3
    host_load_s_per_token: float = 2.6e-6  # 128 KiB per token host -> GPU over 50 GB/s PCIe
    # Attention: each new token attends to the context before it (0.52 MFLOP a pair).
    prefill_s_per_token_pair: float = 1.3e-9
    # Loading a LoRA adapter a worker does not hold (router.adapters): the sim's 10 ms plus
    # 84 MB (rank 16 on every linear layer of Llama-3.1-8B) at 2 GB/s.
    lora_load_s: float = 0.052
    _rule: Decider = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # its queue_s and plan, for admission and /workers (frozen: the constants the native
        # deciders were built with cannot change under them)
        object.__setattr__(self, "_rule", self.decider("cost"))

    def decider(
        self,
        rule: str,
        page_size: int = 16,
        pulls: bool = True,
        thresholds: Thresholds | None = None,
        heat: Heat | None = None,
    ) -> Decider:
        """The native decision with these constants (`rule`: prompt_tree or cost)."""
        t = thresholds or Thresholds()
        return Decider(
            rule,
            page_size,
            pulls,
            t.balance_abs,
            t.balance_rel,
            self.prefill_s_per_token,
            self.transfer_s_per_token,
            self.busy_s_per_request,
            self.host_load_s_per_token,
            self.prefill_s_per_token_pair,
            heat,
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
        return self._rule.queue_s(worker.state, host, load)

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
        """How `worker` would serve a `tokens`-token prompt holding `cached` of it (`host` of
        those on its host tier); `source`, when given, holds `best` and may be pulled from.
        What the decision weighs for each worker (the tests and /workers read it here)."""
        state = source.state if source is not None else None
        seconds, computed, pull, work = self._rule.plan(
            worker.state, tokens, cached, host, state, best, load
        )
        return Plan(seconds, computed, pull, Work(*work))

    def served_work(self, decision: Decision, num_tokens: int, cached: int, pulled: int) -> Work:
        """The work of a request priced at `decision.work`, as its engine's answer says it
        went: `cached` prompt tokens reused from its own cache and `pulled` from a peer's,
        the rest computed. The queue stays as the decision saw it; a pull's transfer per
        token as planned (its link shared with the other pulls from that holder then)."""
        priced = decision.work or Work()
        if num_tokens < 1:  # a prompt not counted: nothing to price it by
            return priced
        reused = min(max(cached, 0) + max(pulled, 0), num_tokens)
        # its own prefill of the rest, by the native arithmetic (the queue it prices is not used)
        own = self._rule.plan(decision.worker.state, num_tokens, reused)[3]
        planned = decision.planned_pull
        per_token = priced.moved_s / planned if planned else self.transfer_s_per_token
        return priced._replace(tokens_s=own[1], pairs_s=own[2], moved_s=max(pulled, 0) * per_token)


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


def select_idle_first(
    policy: Policy, request: RouteRequest, workers: list[Worker], registry: WorkerRegistry
) -> Decision:
    """`policy`'s choice among `workers`, or among the idle ones only while requests wait for
    a slot in the router's queue (WorkerRegistry.idle_first; the reason is then IDLE)."""
    candidates, idle = registry.idle_first(workers)
    decision = policy.select(request, candidates)
    if idle:
        decision.reason = IDLE
    return decision


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


class LoraAffinity(Policy):
    """llm-d's LoRA affinity scorer alone (the adapter-affinity-only peer of issue 38): the
    worker with the adapter loaded, else one with a free slot, else any; ties by least load.
    Blind to prefixes; a request naming no adapter goes to the least loaded worker."""

    name = "lora_affinity"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        adapter = request.adapter
        if adapter is None:
            return Decision(least_loaded(workers), reason="no_adapter")
        scores = [w.adapters.affinity(adapter) for w in workers]
        best = max(scores)
        choice = least_loaded([w for w, s in zip(workers, scores, strict=True) if s == best])
        choice.adapters.sent(adapter)
        reason = "adapter_loaded" if best == 1.0 else "adapter_slot" if best else "adapter_evict"
        return Decision(choice, reason=reason)


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
        heat = Heat(trees.page_size) if self.name == PromptTree.name else None
        self.core = cost.decider(self.name, trees.page_size, pulls, thresholds, heat)
        # the router's trees are walked natively; other trees (a replay's) give their view
        self._native = isinstance(trees, PromptTrees)

    @property
    def heat(self) -> Heat | None:
        """How hot each prefix is (a native Heat: decide.hpp says why it counts); None for the
        cost rule, which ignores it."""
        return self.core.heat

    @heat.setter
    def heat(self, heat: Heat | None) -> None:
        self.core.heat = heat

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        tokens = request.tree_key(request.tokens or (), self.trees.page_size)
        states = [w.state for w in workers]
        adapter = request.adapter
        before = stall = None
        if adapter is not None:  # its load, where the adapter is not in memory
            lora_s = self.cost.lora_load_s
            before = [w.adapters.seconds(adapter, lora_s) for w in workers]
            stall = [w.adapters.stall_s(adapter, lora_s) for w in workers]
        limit = pull_limit(request.namespace, self.trees.page_size)
        if self._native:
            tree = self.trees.trees[request.type]
            choice, reason, cached, longer, pull, work = self.core.decide(
                tree, tokens, request.num_tokens, states, self.trees.ttl_s, before, limit, stall
            )
        else:
            view = self.trees.match(request.type, tokens)
            held = [
                (view.held.get(w.url, -1), view.device.get(w.url, -1), view.home.get(w.url, -1))
                for w in workers
            ]
            choice, reason, cached, longer, pull, work = self.core.decide_view(
                held, tokens, request.num_tokens, states, before, limit, stall
            )
        planned, load_s = Work(*work), 0.0
        if adapter is not None:
            slots = workers[choice].adapters
            if before is not None and stall is not None:
                # the fit subtracts only the part this request waits for
                paid = slots.paid_s(adapter, self.cost.lora_load_s)
                planned = planned._replace(fixed_s=planned.fixed_s - before[choice] + paid)
                load_s = stall[choice]
            slots.sent(adapter)
        holders = [(workers[i], n) for i, n in longer]
        pull_from = workers[pull] if pull is not None else None
        return Decision(workers[choice], cached, holders, reason, pull_from, planned, load_s)


def pull_limit(namespace: CacheNamespace | None, page: int) -> int:
    """The most of a request's prefix the decision prices a pull of (-1: all of it; 0: none,
    and no holders named). A worker pulls a namespaced prefix by its index key, which its
    peers key alike (connector.worker.pull), except an adapter's, keyed by each worker's
    own load of it, which is never pulled. A tenant's prefix is priced as pulled only behind
    a public one (a salt after at least a page of public tokens): salted from the first
    token (or under an extra_key), its moves are priced as recomputes, which keeps one
    tenant's whole private prompt from being copied wherever it waits less. Measured on the
    tenants benchmark, caches half the hot set: priced as pulls, full isolation's moves
    doubled and its mean TTFT went from 1.0-2.4x no isolation's to 1.7-2.5x (one seed 14x),
    copies of private tool prompts evicting each other's in full caches; the public prefix's
    went from 0.9-1.2x to 0.8-1.0x. (A model's key is the router's own, never a worker's.)"""
    if namespace is None:
        return -1
    if namespace.lora_id or namespace.extra_key or namespace.salt_page(page) == 0:
        return 0
    return -1


class Cost(PromptTree):
    """Mooncake-style: the lowest expected TTFT, counting a pull of a longer prefix."""

    name = "cost"


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        RoundRobin,
        Random,
        LeastLoad,
        PowerOfTwo,
        Session,
        LoraAffinity,
        CacheAware,
        PromptTree,
        Cost,
    )
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
