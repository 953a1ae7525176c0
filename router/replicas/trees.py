"""Prompt trees that publish their changes, apply other replicas', and dump their holders.

`ReplicatedTrees` is a PromptTrees whose state-changing calls (record, drop, forget, clear)
also put an operation in the replica's outbox; `apply` performs another replica's operation
without publishing it again (no loops); `snapshot` lists, per holder, the deepest paths it
holds (prefix closure: holding a node means holding its whole path), homes included, which
is all a late replica needs to rebuild the same holdings; `holder_pages` is what tests
compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence

from mempool.radix import TreeNode
from router.replicas.ops import (
    CLEAR,
    DROP,
    FORGET,
    RECORD,
    Op,
    Outbox,
    SnapshotEntry,
    pack_tokens,
    unpack_tokens,
)
from router.trees import PromptTrees, Tier, holder_of
from router.workers import WorkerType

SNAPSHOT_PART = 512  # nodes walked between two chances for requests to run


class ReplicatedTrees(PromptTrees):
    """PromptTrees that tell the other replicas what changed."""

    def __init__(
        self,
        page_size: int = 16,
        ttl_s: float = 300.0,
        max_pages: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(page_size, ttl_s, max_pages, clock)
        self.outbox: Outbox | None = None  # set by the Replicator; None: nothing published
        self._applying = False

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """Changes made inside (another replica's, or their side effects) are not published."""
        before, self._applying = self._applying, True
        try:
            yield
        finally:
            self._applying = before

    def _pages(self, tokens: Sequence[int]) -> Sequence[int]:
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def _emit(self, op: str, **fields: object) -> None:
        if self.outbox is not None and not self._applying:
            self.outbox.emit(op, **fields)

    # ----------------------------------------------------------------- published changes

    def recorded(self, type: WorkerType, url: str, tokens: Sequence[int], tier: Tier) -> None:
        tokens = pack_tokens(self._pages(tokens))
        self._emit(RECORD, type=type.value, url=url, tokens=tokens, tier=tier.value)

    def drop(
        self,
        type: WorkerType,
        url: str,
        tokens: Sequence[int],
        keep_tokens: int,
        tier: Tier | None = None,
    ) -> None:
        super().drop(type, url, tokens, keep_tokens, tier)
        if len(tokens) >= self.page_size:
            self._emit(
                DROP,
                type=type.value,
                url=url,
                tokens=pack_tokens(self._pages(tokens)),
                keep=keep_tokens,
                tier=None if tier is None else tier.value,
            )

    def forget(self, url: str) -> None:
        super().forget(url)
        self._emit(FORGET, url=url)

    def clear(self) -> None:
        super().clear()
        self._emit(CLEAR)

    # ----------------------------------------------------------------- others' changes

    def apply(self, op: Op) -> bool:
        """Perform another replica's tree operation; False if it is not one (or malformed)."""
        try:
            with self.applying():
                if op.op == RECORD:
                    tier = Tier(op.tier or Tier.DEVICE.value)
                    self.record(WorkerType(op.type), op.url, unpack_tokens(op.tokens), tier)
                elif op.op == DROP:
                    tier_or_all = None if op.tier is None else Tier(op.tier)
                    tokens = unpack_tokens(op.tokens)
                    self.drop(WorkerType(op.type), op.url, tokens, op.keep, tier_or_all)
                elif op.op == FORGET:
                    self.forget(op.url)
                elif op.op == CLEAR:
                    self.clear()
                else:
                    return False
        except ValueError:
            return False
        return True

    # ----------------------------------------------------------------- catch-up

    def _walk(self, type: WorkerType) -> Iterator[tuple[TreeNode, bytes]]:
        """Every node of one tree with the token bytes of its path from the root."""
        stack = [(child, child.key) for child in self.trees[type].root.children.values()]
        while stack:
            node, path = stack.pop()
            if not node.valid:  # pruned while the caller let requests run (snapshot_async)
                continue
            yield node, path
            if node.valid:
                stack.extend((child, path + child.key) for child in node.children.values())

    def snapshot(self) -> list[SnapshotEntry]:
        """Per holder, the deepest paths it holds: recording them rebuilds its holdings."""
        out: list[SnapshotEntry] = []
        for entries in self._snapshot_parts():
            out.extend(entries)
        return out

    async def snapshot_async(self) -> list[SnapshotEntry]:
        """`snapshot`, letting requests run between parts (a large tree takes tens of ms).
        Changes made meanwhile may or may not be in it; the stream after the cursor read
        before it began carries them (records and drops apply twice harmlessly)."""
        out: list[SnapshotEntry] = []
        for entries in self._snapshot_parts():
            out.extend(entries)
            await asyncio.sleep(0)
        return out

    def _snapshot_parts(self) -> Iterator[list[SnapshotEntry]]:
        """The snapshot's entries, SNAPSHOT_PART nodes' worth at a time. The walk holds
        each node with its path: a node split meanwhile keeps its lower part (and so its
        path); nodes added after it passed are missed, as changes after the cursor may be."""
        part: list[SnapshotEntry] = []
        visited = 0
        for type in WorkerType:
            for node, path in self._walk(type):
                visited += 1
                if visited % SNAPSHOT_PART == 0:
                    yield part
                    part = []
                if not node.valid or not node.holders:  # pruned meanwhile: the stream says
                    continue
                below: set[Hashable] = set()
                for child in node.children.values():
                    below.update(child.holders or ())
                tokens: bytes | None = None
                for key in list(node.holders):
                    if key in below:
                        continue
                    if tokens is None:  # the tree's key bytes are native uint32s
                        tokens = pack_tokens(unpack_native(path))
                    url, tier = holder_of(key)
                    part.append(SnapshotEntry(type.value, url, tier.value, tokens))
        yield part

    def load(self, entries: Sequence[SnapshotEntry]) -> int:
        """Record a snapshot's entries (not published); returns how many were valid."""
        applied = 0
        with self.applying():
            for e in entries:
                try:
                    self.record(WorkerType(e.type), e.url, unpack_tokens(e.tokens), Tier(e.tier))
                except ValueError:
                    continue
                applied += 1
        return applied

    def holder_pages(self) -> dict[str, dict[str, int]]:
        """Per tree, pages each holder holds ("URL" device, "URL#host" host tier): two
        replicas have converged when these are equal."""
        out: dict[str, dict[str, int]] = {}
        for type in WorkerType:
            page_bytes = self.trees[type].page_bytes
            counts: dict[str, int] = {}
            for node, _ in self._walk(type):
                for key in node.holders or ():
                    url, tier = holder_of(key)
                    label = url if tier is Tier.DEVICE else f"{url}#{tier.value}"
                    counts[label] = counts.get(label, 0) + len(node.key) // page_bytes
            if counts:
                out[type.value] = dict(sorted(counts.items()))
        return out


def unpack_native(raw: bytes) -> array[int]:
    """A tree's key bytes (native-endian uint32s) as token ids."""
    data = array("I")
    data.frombytes(raw)
    return data
