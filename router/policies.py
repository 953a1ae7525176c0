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

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mempool.radix import RadixTree
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

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens (the part not yet encoded estimated)."""
        return len(self.tokens or ()) + self.rest_tokens


@dataclass(slots=True)
class Decision:
    worker: Worker
    predicted_cached: int = 0  # tokens the trees believe the worker will reuse
    holders: list[tuple[str, int]] = field(default_factory=list)  # longer prefixes elsewhere
    reason: str = "policy"


@dataclass(slots=True)
class Thresholds:
    """sglang-router's --cache-threshold, --balance-abs-threshold, --balance-rel-threshold."""

    cache: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5

    def imbalanced(self, high: int, low: int) -> bool:
        return high - low > self.balance_abs and high > low * self.balance_rel


@dataclass(slots=True)
class CostModel:
    """Expected TTFT terms; defaults are the sim's H100 Llama-3.1-8B figures."""

    prefill_s_per_token: float = 4.0e-5
    transfer_s_per_token: float = 5.2e-6  # 128 KiB per token over a 25 GB/s link
    # Requests already running share every engine step with a new prefill: a decode step
    # (6.8 ms) shared by a typical batch puts roughly this much in front of it per request.
    busy_s_per_request: float = 2.0e-3

    def ttft(self, worker: Worker, tokens: int, cached: int, best: int = 0) -> tuple[float, bool]:
        """(expected seconds, whether pulling the longer prefix `best` is the better plan)."""
        queue = worker.queued_tokens * self.prefill_s_per_token
        queue += worker.load * self.busy_s_per_request
        own = queue + (tokens - cached) * self.prefill_s_per_token
        if best <= cached:
            return own, False
        pull = queue + (best - cached) * self.transfer_s_per_token
        pull += (tokens - best) * self.prefill_s_per_token
        return (pull, True) if pull < own else (own, False)


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

    The holder of the longest prefix wins unless another worker is expected to start the
    request sooner (Mooncake's TTFT estimate: queued work plus the uncached prefill, no pull
    assumed) by more than the recomputed prefix costs the requests queued behind it, or
    unless loads are imbalanced by sglang-router's thresholds. Without the
    estimate a prefix every request shares (a system prompt, a trace's first block) would pull
    all traffic to whichever worker saw it first.
    """

    name = "prompt_tree"
    uses_tokens = True

    def __init__(self, trees: PromptTrees, thresholds: Thresholds, cost: CostModel) -> None:
        self.trees = trees
        self.thresholds = thresholds
        self.cost = cost

    def _predicted(self, held: int, n: int) -> int:
        # The engine always computes the last prompt token; it reuses whole pages only.
        page = self.trees.page_size
        return min(held, n - 1) // page * page

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        tokens = request.tokens or []
        n = request.num_tokens
        view = self.trees.match(request.type, tokens)
        held = {w.url: self._predicted(view.held.get(w.url, 0), n) for w in workers}
        most = max(held.values())
        # Expected TTFT on each worker, plus the cached prefix it would recompute once more:
        # that work also delays every request queued behind it, so leaving a holder must win
        # by more than this request's own TTFT.
        per_token = self.cost.prefill_s_per_token
        placement = {
            w.url: self.cost.ttft(w, n, held[w.url])[0] + (most - held[w.url]) * per_token
            for w in workers
        }
        soonest = min(workers, key=lambda w: (placement[w.url], w.load))
        if most == 0:
            return self._decide(soonest, "cache_miss", n, view)
        best = max(workers, key=lambda w: (held[w.url], -w.load))
        low = min(w.load for w in workers)
        if self.thresholds.imbalanced(best.load, low):  # sglang-router's rule: the lightest
            lightest = min((w for w in workers if w.load == low), key=lambda w: placement[w.url])
            return self._decide(lightest, "overload", n, view)
        if soonest is not best and placement[soonest.url] < placement[best.url]:
            return self._decide(soonest, "overload", n, view)
        return self._decide(best, "cache_hit", n, view)

    def _decide(self, choice: Worker, reason: str, n: int, view: PrefixView) -> Decision:
        mine = view.held.get(choice.url, 0)
        holders = sorted(((u, k) for u, k in view.held.items() if k > mine), key=lambda x: -x[1])
        return Decision(choice, self._predicted(mine, n), holders, reason)


class Cost(PromptTree):
    """Mooncake-style: the lowest expected TTFT, counting a pull of a longer prefix."""

    name = "cost"

    def select(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        n = request.num_tokens
        view = self.trees.match(request.type, request.tokens or [])
        held = {w.url: view.held.get(w.url, 0) for w in workers}
        return self._decide(cheapest(self.cost, workers, n, held), "cost", n, view)


def cheapest(cost: CostModel, workers: list[Worker], n: int, held: dict[str, int]) -> Worker:
    best = max(held.values(), default=0)
    return min(workers, key=lambda w: (cost.ttft(w, n, held[w.url], best)[0], w.load))


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


def make_policy(name: str, trees: PromptTrees, thresholds: Thresholds, cost: CostModel) -> Policy:
    """The policy named `name` (either spelling); ValueError for unknown names."""
    canonical = policy_name(name)
    if canonical == CacheAware.name:
        return CacheAware(thresholds)
    if canonical == PromptTree.name:
        return PromptTree(trees, thresholds, cost)
    if canonical == Cost.name:
        return Cost(trees, thresholds, cost)
    return POLICIES[canonical]()
