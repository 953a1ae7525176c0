"""The worker's KV memory on MemPool: request blocks, the prefix index, tiers, KV events.

One owner for everything the scheduler, admission and the PD hooks do to MemPool: allocate
(making room from historical KV when memory runs short), match a prompt's cached prefix,
write a request's pages and insert them into the index, publish each change as a KV event.

With a host tier (SGLang's hierarchical cache) requests compute into device blocks. Room on
the device is made by swapping the least recently used historical device pages out to the
host tier (`swap_out`), and room on the host by dropping its least recently used leaves, so
host eviction drops last. A matched prefix that reaches host pages is swapped back in
(`load`) before its request prefills, pinned by the request's lock. Every move is published
as KV events with SGLang's `medium`: BlockRemoved(GPU) + BlockStored(CPU_PINNED) for a
swap-out, the reverse for a swap-in, BlockRemoved(CPU_PINNED) for a host drop. Without a
host tier nothing carries a medium and memory is made by dropping, as before.

Cache namespaces (`shared/namespaces.py`): every token-keyed call takes the request's namespace and
keys the index by `CacheNamespace.key`; KV events of namespaced pages carry the real tokens,
hashes of the key, the adapter's `lora_id` and `metadata` (remembered per page, so that
their moves between tiers say it again). Pages inserted by a transfer (`note_inserted`)
arrive keyed already: their events carry the key's tokens (a derived page's ids, which no
prompt matches) and no metadata.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any

from connector.worker.backend import Backend
from connector.worker.sequence import Sequence
from mempool import InsertFlags, InsertResult, MemPool, MemType, OutOfBlocks, PrefixMatch
from mempool.address import mem_type_of
from mempool.errors import BlockInUse, InvalidRequest
from mempool.pool import Moved
from mempool.transfer.receiver import Received
from shared.kv_events import BlockStoredMetadata, KVEventPublisher, page_hashes
from shared.namespaces import CacheNamespace, key_tokens
from shared.path_shares import PathShares

# SGLang's StorageMedium names for our tiers (KV events' `medium`).
MEDIUM = {MemType.DEVICE: "GPU", MemType.HOST: "CPU_PINNED"}


@dataclass(slots=True)
class TierCounters:
    """What moved between the tiers so far (pages), and the time it took: modelled seconds
    for the sim (its pages stand in for bigger ones), measured copy time otherwise."""

    swapped_out_pages: int = 0
    swapped_in_pages: int = 0
    dropped_device_pages: int = 0
    dropped_host_pages: int = 0
    load_s: float = 0.0  # host -> device, on the critical path of the request that loads
    swap_out_s: float = 0.0  # device -> host, off the critical path (its own stream)


def host_tier_tokens(
    device_tokens: int, ratio: float | None, size_gb: int | None, bytes_per_token: int
) -> int:
    """Host tier capacity in tokens from SGLang's flags: `size_gb` (decimal GB of KV at
    `bytes_per_token`) when > 0, else `ratio` x the device tier; ValueError naming the flag
    when a value is unusable."""
    if size_gb is not None and size_gb < 0:
        raise ValueError(f"--hicache-size must be >= 0 GB, got {size_gb}")
    if size_gb:
        return int(size_gb * 1e9 // bytes_per_token)
    ratio = 2.0 if ratio is None else ratio
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"--hicache-ratio must be a positive number, got {ratio}")
    return int(device_tokens * ratio)


class KVCache:
    """Blocks and cached prefixes of one worker's MemPool, as its requests use them."""

    def __init__(
        self, pool: MemPool, backend: Backend, events: KVEventPublisher | None = None
    ) -> None:
        self.pool = pool
        self.backend = backend  # writes a request's KV into blocks
        self.events = events
        self.page = pool.spec.page_size
        self.bpp = pool.blocks_per_page
        self.tiered = pool.tiered
        # The tier requests compute into: the device when there is a host tier behind it.
        self.request_tier = MemType.DEVICE if self.tiered else next(iter(pool.allocators))
        self.evicted_blocks = 0
        self.tiers = TierCounters()
        # Seconds to copy so many pages between host and device, when modelled.
        self.copy_model: Callable[[int], float] | None = backend.host_copy_model()
        self._hash_of_block: dict[int, int] = {}  # historical page's first block -> page hash
        self._parent_hash: dict[int, int | None] = {}  # page hash -> the previous page's
        # Namespaced pages: hash -> (lora_id, metadata, the real tokens) for their events.
        self._ns_pages: dict[int, tuple[int | None, BlockStoredMetadata, list[int]]] = {}
        # Pages a decode instance wrote back here (PD-Caching-3), by hash, while cached: a
        # request reusing them reports them apart (its hit came from the decode's KV).
        self._written_back: set[int] = set()
        # --max-cached-tokens-per-salt: each salt group's pages, bounded (shared.path_shares)
        self.salt_shares: PathShares | None = None

    # ----------------------------------------------------------------- capacity

    @property
    def request_capacity_blocks(self) -> int:
        """Blocks one request can ever hold (the tier requests allocate from)."""
        return self.pool.allocators[self.request_tier].num_blocks

    @property
    def capacity_tokens(self) -> int:
        """KV capacity of the tier requests compute into (SGLang's max_total_num_tokens)."""
        return self.request_capacity_blocks // self.bpp * self.page

    @property
    def used_tokens(self) -> int:
        return self.pool.allocators[self.request_tier].num_used // self.bpp * self.page

    @property
    def pinned_pages(self) -> int:
        """Cached pages locked by a request, a transfer or a peer's pull."""
        return self.pool.index.protected_pages

    def host_tokens(self) -> tuple[int, int]:
        """(used, capacity) of the host tier in tokens; (0, 0) without one."""
        if not self.tiered:
            return 0, 0
        host = self.pool.allocators[MemType.HOST]
        return host.num_used // self.bpp * self.page, host.num_blocks // self.bpp * self.page

    def stats(self) -> dict[str, Any]:
        """MemPool's own report (tiers, index)."""
        return self.pool.stats()

    def tier_report(self, device_hits: int, host_hits: int) -> dict[str, Any]:
        """/get_server_info's `kv_tiers`: each tier's capacity, use and hits (tokens)."""
        used, capacity = self.used_tokens, self.capacity_tokens
        out: dict[str, Any] = {
            "device": {"capacity_tokens": capacity, "used_tokens": used, "hit_tokens": device_hits}
        }
        if self.tiered:
            host_used, host_capacity = self.host_tokens()
            t = self.tiers
            out["host"] = {
                "capacity_tokens": host_capacity,
                "used_tokens": host_used,
                "hit_tokens": host_hits,
                "swapped_out_tokens": t.swapped_out_pages * self.page,
                "swapped_in_tokens": t.swapped_in_pages * self.page,
                "dropped_tokens": t.dropped_host_pages * self.page,
                "load_s": round(t.load_s, 6),
                "swap_out_s": round(t.swap_out_s, 6),
                "seconds": "modelled" if self.copy_model is not None else "measured",
            }
            out["device"]["dropped_tokens"] = t.dropped_device_pages * self.page
        return out

    # ----------------------------------------------------------------- blocks

    def alloc(self, count: int, tier: MemType | None = None) -> list[int] | None:
        """`count` blocks, making room from historical KV if needed; None if requests hold
        the memory."""
        if count <= 0:
            return []
        tier = self.request_tier if tier is None else tier
        try:
            return self.pool.alloc_blocks(count, tier)
        except OutOfBlocks:
            pass
        self._make_room(count, tier)
        try:
            return self.pool.alloc_blocks(count, tier)
        except OutOfBlocks:
            return None

    def alloc_for_peer(self, count: int, tier: MemType) -> list[int]:
        """Blocks for KV a peer sends: room made like any request's; OutOfBlocks if held."""
        blocks = self.alloc(count, tier)
        if blocks is None:
            raise OutOfBlocks(
                f"{count} blocks for incoming KV: every block is held by running requests"
            )
        return blocks

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self.pool.free_mem(blocks)

    def _make_room(self, count: int, tier: MemType) -> None:
        """Free `count` blocks of `tier` from historical KV (as SGLang evicts what it
        allocates): device pages go to the host tier when there is one, else they are
        dropped."""
        allocator = self.pool.allocators[tier]
        if self.tiered and tier is MemType.DEVICE:
            self._swap_out(count)
        else:
            self._drop(count, tier)
        while allocator.num_free < count:
            if not self._drop(count - allocator.num_free, tier):
                return

    def _swap_out(self, count: int) -> int:
        """Move `count` device blocks of historical KV to the host tier, dropping host leaves
        for room first; returns the blocks moved."""
        host = self.pool.allocators[MemType.HOST]
        if host.num_free < count:
            self._drop(count - host.num_free, MemType.HOST)
        count = min(count, host.num_free)
        if count <= 0:
            return 0
        started = time.perf_counter()
        runs = self.pool.swap_out_runs(count)
        pages = sum(len(run.new) for run in runs) // self.bpp
        self.tiers.swapped_out_pages += pages
        self.tiers.swap_out_s += self._copy_seconds(pages, started)
        self._publish_moves(runs, MemType.DEVICE, MemType.HOST)
        return pages * self.bpp

    def _drop(self, count: int, tier: MemType) -> int:
        """Drop at least `count` historical blocks of `tier` (what hangs below them too);
        returns the blocks freed."""
        freed = self.pool.evict(count, tier)
        self.evicted_blocks += len(freed)
        self._forget(freed)
        return len(freed)

    def _forget(self, freed: list[int]) -> None:
        """Historical blocks left the index (evicted or deleted): their pages' bookkeeping
        goes, and KV events say so."""
        gone: dict[MemType, list[int]] = {}
        for addr in freed[:: self.bpp]:  # a page's first block names it
            page_hash = self._hash_of_block.pop(addr, None)
            mem = MemType(mem_type_of(addr)) if self.tiered else self.request_tier
            if mem is MemType.HOST:
                self.tiers.dropped_host_pages += 1
            else:
                self.tiers.dropped_device_pages += 1
            if page_hash is not None:
                self._parent_hash.pop(page_hash, None)
                self._ns_pages.pop(page_hash, None)
                self._written_back.discard(page_hash)
                gone.setdefault(mem, []).append(page_hash)
        if self.events is not None:
            for mem, hashes in gone.items():
                self.events.removed(hashes, self._medium(mem))

    # ----------------------------------------------------------------- salt shares

    def _charge_salt(self, ns: CacheNamespace | None, key: Tokens[int], added: int) -> None:
        """`added` new pages on path `key` (index keys) of a salted request, counted to its
        salt group (the salt up to its first ':'), whose oldest paths go over its share."""
        salt = ns.cache_salt if ns is not None else None
        if self.salt_shares is not None and salt:
            self.salt_shares.charge("kv", salt.split(":", 1)[0], key, added, self)

    def remove(self, tokens: array[int]) -> int:
        """A salt group over its share: its path `tokens` (index keys) goes, as far as no
        other path uses it and no request holds it; the pages freed (shared.path_shares)."""
        try:
            freed = self.pool.delete(tokens)
        except (BlockInUse, InvalidRequest):
            return 0  # a request is using it: it stays
        self._forget(freed)
        return len(freed) // self.bpp

    def holds(self, tokens: array[int]) -> bool:
        return self.pool.index.match(tokens).num_tokens >= len(tokens)

    def _copy_seconds(self, pages: int, started: float) -> float:
        if self.copy_model is not None:
            return self.copy_model(pages) if pages else 0.0
        return time.perf_counter() - started

    # ----------------------------------------------------------------- the prefix index

    def key(self, tokens: Tokens[int], ns: CacheNamespace | None) -> Tokens[int]:
        """`tokens` as the index keys them in namespace `ns`."""
        return key_tokens(tokens, ns, self.page)

    def match(
        self, tokens: Tokens[int], max_tokens: int | None = None, ns: CacheNamespace | None = None
    ) -> PrefixMatch:
        """The longest cached prefix of `tokens[:max_tokens]` in namespace `ns`, pinned until
        `release`. Its pages may be on the host tier (`host_pages`) until `load` brings them
        in."""
        if max_tokens is not None:
            tokens = tokens[: max(max_tokens, 1)]  # (one token matches no page)
        return self.pool.match(self.key(tokens, ns), lock=True)

    def host_pages(self, prefix: PrefixMatch) -> int:
        """Pages of a match that are on the host tier."""
        if not self.tiered:
            return 0
        host = int(MemType.HOST)
        return sum(1 for a in prefix.addrs[:: self.bpp] if mem_type_of(a) == host)

    def load(self, prefix: PrefixMatch, then: int = 0) -> int | None:
        """Swap a pinned match's host pages into device blocks, with room for `then` more
        blocks after them; returns the tokens loaded, None when the device has no room (the
        match is unchanged). A host page someone else is reading is not moved: the match is
        cut before it."""
        pages = self.host_pages(prefix)
        if not pages:
            return 0
        need = pages * self.bpp + then
        device = self.pool.allocators[MemType.DEVICE]
        if device.num_free < need:
            self._make_room(need, MemType.DEVICE)
        started = time.perf_counter()
        try:
            runs = self.pool.swap_in_match(prefix)
        except OutOfBlocks:
            return None
        loaded = sum(len(run.new) for run in runs) // self.bpp
        self.tiers.swapped_in_pages += loaded
        self.tiers.load_s += self._copy_seconds(loaded, started)
        self._publish_moves(runs, MemType.HOST, MemType.DEVICE)
        return loaded * self.page

    def written_back_tokens(self, prefix: PrefixMatch | None) -> int:
        """Tokens of a match whose pages a decode instance wrote back (`note_inserted`)."""
        if prefix is None or not self._written_back:
            return 0
        hashes = map(self._hash_of_block.get, prefix.addrs[:: self.bpp])
        return sum(1 for h in hashes if h in self._written_back) * self.page

    def lookup(self, tokens: Tokens[int], ns: CacheNamespace | None = None) -> list[int]:
        """The index's blocks for `tokens` (all cached, in namespace `ns`), not pinned."""
        return self.pool.match(self.key(tokens, ns)).addrs

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
        key = self.key(tokens, seq.namespace)
        if self.tiered:  # pages cached on the host that this request recomputed
            self._publish_moves(self.pool.promote(key, addrs), MemType.HOST, MemType.DEVICE)
        result = self.pool.insert(key, addrs, flags)  # validates before it changes anything
        stored = result.new_tokens // self.page
        self._charge_salt(seq.namespace, key, stored)
        if stored:
            self._learn(tokens, full - stored, addrs[(full - stored) * self.bpp :], seq.namespace)
        return result

    def note_inserted(
        self,
        tokens: Tokens[int],
        first_page: int,
        num_pages: int,
        written_back: bool = False,
        ns: CacheNamespace | None = None,
    ) -> None:
        """Pages `first_page`.. of `tokens` entered the index by another path (a transfer or
        pull inserted them, keyed in namespace `ns`): learn their blocks and publish them, so
        that their later moves and drops are published too, and charge a salt's pages to its
        group's share as a computed insert is. `written_back`: a decode instance sent them
        (counted apart when a request reuses them, until they are dropped)."""
        if num_pages <= 0:
            return
        key = self.key(tokens[: (first_page + num_pages) * self.page], ns)
        addrs = self.pool.match(key).addrs
        first_page = min(first_page, len(addrs) // self.bpp)  # (evicted since: none to learn)
        self._charge_salt(ns, key, len(addrs) // self.bpp - first_page)
        self._learn(tokens, first_page, addrs[first_page * self.bpp :], ns)
        if written_back:
            hashes = map(self._hash_of_block.get, addrs[first_page * self.bpp :: self.bpp])
            self._written_back.update(h for h in hashes if h is not None)

    def note_written_back(self, received: Received) -> None:
        """A decode instance's write-back was inserted here: its new pages are learned (and
        published) as written back. Pages another insert made first between the transfer's
        prepare and commit count too (the index keeps one copy; which one is not told)."""
        if received.tokens is None:
            return
        whole = received.num_tokens // self.page
        self.note_inserted(
            received.tokens, received.cached_pages, whole - received.cached_pages, True
        )

    def _learn(
        self, tokens: Tokens[int], first: int, blocks: list[int], ns: CacheNamespace | None = None
    ) -> None:
        """Remember pages first.. of `tokens` (in `blocks`, namespace `ns`) by hash and
        publish them."""
        pages = len(blocks) // self.bpp
        end = (first + pages) * self.page
        hashes = page_hashes(self.key(tokens[:end], ns), self.page)
        firsts = blocks[:: self.bpp]
        for i in range(first, first + pages):
            self._hash_of_block[firsts[i - first]] = hashes[i]
            self._parent_hash[hashes[i]] = hashes[i - 1] if i else None
        if ns is not None:
            lora_id = fold_id(ns.lora_id) if ns.lora_id else None
            for i in range(first, first + pages):
                meta = ns.event_metadata(i, self.page)
                if meta:
                    real = list(tokens[i * self.page : (i + 1) * self.page])
                    self._ns_pages[hashes[i]] = (lora_id, BlockStoredMetadata(**meta), real)
        if self.events is not None and pages:
            medium = self._medium(MemType(mem_type_of(firsts[0])))
            if ns is None:
                self.events.stored(tokens, first, pages, medium)
            else:
                ps = self.page
                self._publish_stored(
                    hashes[first : first + pages], list(tokens[first * ps : end]), medium
                )

    def _publish_stored(self, hashes: list[int], token_ids: list[int], medium: str | None) -> None:
        """BlockStored events for pages known by hash, one per run of pages in the same
        namespace (a public prefix and the salted rest after it are two)."""
        assert self.events is not None
        ps = self.page
        start = 0
        for i in range(1, len(hashes) + 1):
            info = self._ns_pages.get(hashes[start])
            if i < len(hashes) and _same_ns(self._ns_pages.get(hashes[i]), info):
                continue
            run = hashes[start:i]
            ids: list[int] = []
            for j, page_hash in enumerate(run, start):
                known = self._ns_pages.get(page_hash)
                ids += known[2] if known is not None else token_ids[j * ps : (j + 1) * ps]
            self.events.moved(
                run,
                self._parent_hash.get(run[0]),
                ids,
                medium,
                info[0] if info is not None else None,
                info[1] if info is not None else None,
            )
            start = i

    def flush(self) -> None:
        """Drop all historical KV."""
        self.pool.flush()
        self._hash_of_block.clear()
        self._parent_hash.clear()
        self._ns_pages.clear()
        self._written_back.clear()
        if self.events is not None:
            self.events.cleared()
            self.events.flush()

    # ----------------------------------------------------------------- events

    def _medium(self, mem: MemType) -> str | None:
        return MEDIUM[mem] if self.tiered else None

    def _publish_moves(self, runs: Iterable[Moved], src: MemType, dst: MemType) -> None:
        """Pages that changed tier: their hashes follow the blocks; one BlockRemoved from the
        old tier and one BlockStored in the new tier per run of pages."""
        for run in runs:
            hashes = [self._hash_of_block.pop(a, None) for a in run.old[:: self.bpp]]
            for addr, page_hash in zip(run.new[:: self.bpp], hashes, strict=True):
                if page_hash is not None:
                    self._hash_of_block[addr] = page_hash
            known = [h for h in hashes if h is not None]
            if self.events is None or len(known) != len(hashes) or not known:
                continue  # pages never published (inserted behind our back) stay unpublished
            self.events.removed(known, MEDIUM[src])
            self._publish_stored(known, run.tokens.tolist(), MEDIUM[dst])

    def publish(self) -> None:
        """Send the KV events of this step."""
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


def fold_id(lora_id: str) -> int:
    """An adapter's id (a uuid hex) as KV events' `lora_id`: a signed int64."""
    digest = hashlib.sha256(lora_id.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _same_ns(
    a: tuple[int | None, BlockStoredMetadata, list[int]] | None,
    b: tuple[int | None, BlockStoredMetadata, list[int]] | None,
) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and a[1] == b[1]
