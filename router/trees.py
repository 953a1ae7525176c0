"""Global prompt trees (MemServe section 6): which instance holds which token prefix.

One RadixTree per instance type (prefill, decode, colocated), the same tree type as
MemPool's index, with each node's `holders` mapping a worker URL to when its holding was
last confirmed. Updated optimistically on dispatch, again when the response passes back
(prompt plus generated tokens: the next turn's prefix), exactly from KV events where
workers publish them, and corrected by feedback: a worker reporting fewer cached tokens
than predicted loses the rest of that path at once. Entries expire after a TTL; a size
bound evicts least-recently-used leaves.

Tiers: a worker with a host DRAM tier behind its GPU memory holds a prefix partly in each.
Its device holding is recorded under its URL, its host holding under (URL, "host"), so one
match tells per worker how much of the prefix it holds and how much of that is on its device
(KV events with SGLang's `medium` say which; what the router routes itself is on device).

Homes: a prefix a worker dropped (evicted, or reported missing) stays recorded under
(URL, "home") until the TTL: where that prefix lived. A prefix that comes back after its
eviction is best computed where it lived (cache-aware routing's stickiness), or every
eviction scatters it to another worker and the caches fill with copies of the same prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, cast

from mempool.radix import RadixTree
from router.workers import WorkerType

if TYPE_CHECKING:
    from array import array

    from shared.path_shares import PathShares

_HOME = "home"


class Tier(Enum):
    """Where a worker keeps a cached page: its device (GPU) memory or its host DRAM."""

    DEVICE = "device"
    HOST = "host"
    HOME = "home"  # not held any more: where it was held last (see the module's docstring)

    @classmethod
    def of_medium(cls, medium: str | None) -> Tier:
        """SGLang's KV-event medium ("GPU", "CPU_PINNED", ...; None: GPU) as a tier."""
        return cls.DEVICE if medium is None or medium.upper() == "GPU" else cls.HOST


def _key(url: str, tier: Tier) -> str | tuple[str, str]:
    return url if tier is Tier.DEVICE else (url, tier.value)


def holder_of(key: object) -> tuple[str, Tier]:
    """A tree holder key (URL, or (URL, tier)) as (URL, tier)."""
    if isinstance(key, tuple):
        return str(key[0]), Tier(key[1])
    return str(key), Tier.DEVICE


@dataclass(slots=True)
class PrefixView:
    """What the trees know about one prompt: tokens each worker is believed to hold."""

    held: dict[str, int]  # worker URL -> cached prefix tokens in any tier (page-aligned)
    device: dict[str, int] = field(default_factory=dict)  # of which on its device tier
    home: dict[str, int] = field(default_factory=dict)  # tokens it held before dropping them

    def affinity(self, url: str) -> int:
        """Tokens of the prefix that live, or lived last, on this worker."""
        return max(self.held.get(url, 0), self.home.get(url, 0))

    def host(self, url: str) -> int:
        """Tokens of the worker's held prefix that sit on its host tier."""
        return max(self.held.get(url, 0) - self.device.get(url, 0), 0)


@dataclass(slots=True)
class TreeStats:
    """Prediction quality: what the trees predicted versus what workers reported."""

    predicted_tokens: int = 0
    reported_tokens: int = 0
    corrections: int = 0
    expired_pages: int = 0


@dataclass(slots=True)
class _Paths:
    """A prompt tree as a tenant's share removes from it (shared.path_shares.Paths)."""

    tree: RadixTree

    def remove(self, tokens: array[int]) -> int:
        before = self.tree.num_pages
        self.tree.delete(tokens)
        return before - self.tree.num_pages

    def holds(self, tokens: array[int]) -> bool:
        found = self.tree.holders(tokens)
        return bool(found) and max(found.values()) >= len(tokens)


class PromptTrees:
    """A tree per instance type; every call names the type it is about."""

    def __init__(
        self,
        page_size: int = 16,
        ttl_s: float = 300.0,
        max_pages: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_size = page_size
        self.ttl_s = ttl_s
        self.max_pages = max_pages
        self.clock = clock
        self.trees = {t: RadixTree(page_size, slots_per_page=0, clock=clock) for t in WorkerType}
        self.stats = TreeStats()
        # with tenants: each tenant's pages, bounded by its share (shared.path_shares)
        self.shares: PathShares | None = None

    def match(self, type: WorkerType, tokens: Sequence[int]) -> PrefixView:
        """Per worker, the page-aligned prefix of `tokens` it is believed to hold now."""
        if len(tokens) < self.page_size:
            return PrefixView({})
        found = self.trees[type].holders(tokens, ttl=self.ttl_s)
        # holders of these trees are worker URLs (device) and (URL, tier) pairs
        keys = cast(dict[str | tuple[str, str], int], found)
        held: dict[str, int] = {}
        device: dict[str, int] = {}
        home: dict[str, int] = {}
        for key, n in keys.items():
            if isinstance(key, str):
                device[key] = n
                url = key
            elif key[1] == _HOME:
                home[key[0]] = n
                continue
            else:
                url = key[0]
            if n > held.get(url, 0):
                held[url] = n
        return PrefixView(held, device, home)

    def record(
        self,
        type: WorkerType,
        url: str,
        tokens: Sequence[int],
        tier: Tier = Tier.DEVICE,
        tenant: str | None = None,
    ) -> None:
        """`url` holds (or is about to hold) the whole pages of `tokens` in `tier`;
        `tenant`: whose request's prompt they are (counted against its share)."""
        if len(tokens) < self.page_size:
            return
        tree = self.trees[type]
        if tenant is None or self.shares is None:
            tree.insert(tokens, holder=_key(url, tier))
        else:
            before = tree.num_pages
            tree.insert(tokens, holder=_key(url, tier))
            self.shares.charge(type, tenant, tokens, tree.num_pages - before, _Paths(tree))
        if tree.num_pages > self.max_pages:
            tree.evict(tree.num_pages - self.max_pages * 9 // 10)
        self.recorded(type, url, tokens, tier)

    def recorded(self, type: WorkerType, url: str, tokens: Sequence[int], tier: Tier) -> None:
        """After each record of whole pages: nothing here (replicas publish it)."""

    def feedback(
        self, type: WorkerType, url: str, tokens: Sequence[int], predicted: int, reported: int
    ) -> None:
        """The worker reported `reported` cached tokens where `predicted` were expected.

        Holding less means it evicted: drop the rest of that path for it at once.
        """
        self.stats.predicted_tokens += predicted
        self.stats.reported_tokens += reported
        if reported < predicted and len(tokens) >= self.page_size:
            self.stats.corrections += 1
            self.drop(type, url, tokens, reported)

    def drop(
        self,
        type: WorkerType,
        url: str,
        tokens: Sequence[int],
        keep_tokens: int,
        tier: Tier | None = None,
    ) -> None:
        """`url` no longer holds `tokens` beyond their first `keep_tokens` in `tier` (None:
        in any tier): it evicted or moved them. The path stays its home (until the TTL)."""
        if len(tokens) < self.page_size:
            return
        tree = self.trees[type]
        ps = self.page_size
        if tier is not Tier.HOME and len(tokens) // ps > max(keep_tokens, 0) // ps:
            tree.insert(tokens, holder=_key(url, Tier.HOME))  # some page goes: home
        for t in (Tier.DEVICE, Tier.HOST) if tier is None else (tier,):
            tree.remove_holder(_key(url, t), tokens, keep_tokens=keep_tokens)

    def forget(self, url: str) -> None:
        """A removed or dead worker holds nothing any more."""
        for tree in self.trees.values():
            for tier in Tier:
                tree.remove_holder(_key(url, tier))

    def expire(self) -> int:
        """Drop entries not confirmed within the TTL; returns the pages pruned."""
        cutoff = self.clock() - self.ttl_s
        pruned = sum(tree.expire(cutoff) for tree in self.trees.values())
        self.stats.expired_pages += pruned
        return pruned

    def clear(self) -> None:
        for tree in self.trees.values():
            tree.reset()
        if self.shares is not None:
            self.shares.clear()

    def size(self, type: WorkerType) -> int:
        return self.trees[type].num_pages
