"""The worker's KV memory on MemPool: request blocks, the prefix index, KV events.

One owner for everything the scheduler, admission and the PD hooks do to MemPool: allocate
(evicting least-recently-used historical KV when memory runs short), match a prompt's cached
prefix, write a request's pages and insert them into the index, publish each change as a KV
event. A host DRAM tier (evicted device blocks swapped out to host, host hits swapped back in
before prefill) changes `alloc` and `match` here and nothing in the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from typing import Any

from connector.kv_events import KVEventPublisher, page_hashes
from connector.worker.backend import Backend
from connector.worker.sequence import Sequence
from mempool import InsertFlags, InsertResult, MemPool, MemType, OutOfBlocks, PrefixMatch


class KVCache:
    """Blocks and cached prefixes of one worker's MemPool, as its requests use them."""

    def __init__(
        self, pool: MemPool, backend: Backend, events: KVEventPublisher | None = None
    ) -> None:
        self.pool = pool
        self.backend = backend  # writes a request's KV into blocks
        self.events = events
        self.page = pool.spec.page_size
        self.evicted_blocks = 0
        self._hash_of_block: dict[int, int] = {}  # historical block -> page hash (events)

    # ----------------------------------------------------------------- capacity

    @property
    def request_capacity_blocks(self) -> int:
        """Blocks one request can ever hold (the tier requests allocate from)."""
        return self.pool.allocators[next(iter(self.pool.allocators))].num_blocks

    @property
    def capacity_tokens(self) -> int:
        return sum(a.num_blocks for a in self.pool.allocators.values()) * self.page

    @property
    def used_tokens(self) -> int:
        return sum(a.num_used for a in self.pool.allocators.values()) * self.page

    def stats(self) -> dict[str, Any]:
        """MemPool's own report (tiers, index)."""
        return self.pool.stats()

    # ----------------------------------------------------------------- blocks

    def alloc(self, count: int, tier: MemType = MemType.HOST) -> list[int] | None:
        """`count` blocks, evicting historical KV if needed; None if requests hold the memory."""
        if count <= 0:
            return []
        try:
            return self.pool.alloc_blocks(count, tier)
        except OutOfBlocks:
            pass
        freed = self.pool.evict(count)
        self.evicted_blocks += len(freed)
        if self.events is not None:
            self.events.removed(
                self._hash_of_block.pop(a) for a in freed if a in self._hash_of_block
            )
        try:
            return self.pool.alloc_blocks(count, tier)
        except OutOfBlocks:
            return None

    def alloc_for_peer(self, count: int, tier: MemType) -> list[int]:
        """Blocks for KV a peer sends: evicting cache like any request; OutOfBlocks if held."""
        blocks = self.alloc(count, tier)
        if blocks is None:
            raise OutOfBlocks(
                f"{count} blocks for incoming KV: every block is held by running requests"
            )
        return blocks

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self.pool.free_mem(blocks)

    # ----------------------------------------------------------------- the prefix index

    def match(self, tokens: Tokens[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens`, pinned until `release`."""
        return self.pool.match(tokens, lock=True)

    def lookup(self, tokens: Tokens[int]) -> list[int]:
        """The index's blocks for `tokens` (all cached), not pinned."""
        return self.pool.match(tokens).addrs

    def release(self, pinned: PrefixMatch | InsertResult) -> None:
        self.pool.release(pinned)

    def write(self, seq: Sequence, first_page: int, blocks: list[int], partial: bool) -> None:
        """Write the KV of pages `first_page`.. of `seq` into `blocks` (partial: a last page
        only partly computed is written too)."""
        self.backend.store_pages(seq, first_page, blocks, partial=partial)

    def keep(self, seq: Sequence, full: int, adopt: list[int]) -> None:
        """Context caching: the request's first `full` pages become historical KV; `adopt`
        holds its pages after the cached prefix (written here)."""
        self._insert(seq, full, adopt, InsertFlags.NONE)

    def keep_pinned(self, seq: Sequence, full: int, adopt: list[int]) -> InsertResult:
        """`keep`, with the inserted path pinned (while its KV is sent on) until `release`."""
        return self._insert(seq, full, adopt, InsertFlags.LOCK)

    def _insert(
        self, seq: Sequence, full: int, adopt: list[int], flags: InsertFlags
    ) -> InsertResult:
        cached_pages = seq.cached_tokens // self.page
        if adopt:
            self.write(seq, cached_pages, adopt, partial=False)
        addrs = (seq.prefix.addrs if seq.prefix is not None else []) + adopt
        tokens = seq.all_ids[: full * self.page]
        result = self.pool.insert(tokens, addrs, flags)  # validates before it changes anything
        stored = result.new_tokens // self.page
        if stored:
            hashes = page_hashes(tokens, self.page)[full - stored :]
            self._hash_of_block.update(zip(addrs[full - stored :], hashes, strict=True))
            if self.events is not None:
                self.events.stored(tokens, full - stored, stored)
        return result

    def flush(self) -> None:
        """Drop all historical KV."""
        self.pool.flush()
        self._hash_of_block.clear()
        if self.events is not None:
            self.events.cleared()
            self.events.flush()

    # ----------------------------------------------------------------- events

    def publish(self) -> None:
        """Send the KV events of this step."""
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
