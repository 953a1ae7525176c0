"""MemPool: one instance's KV memory (tiers of fixed-size blocks) and its prompt index.

The API keeps MemServe's names (Table 1): alloc_mem/free_mem, insert/match/delete,
swap_out/swap_in. Blocks a running request owns are *active*; `insert` turns them into
*historical* KV that later requests `match`, and that eviction or swapping may move once no
request holds a lock on it.

With both a device and a host tier, every index node lives wholly in one tier (its `tier` is
the MemType value) and device pages sit above host pages on a path: swap-out takes the least
recently used device nodes whose children are all on the host (splitting one to move just its
tail), eviction drops host leaves before anything on the device, a locked match's host pages
come back by `swap_in_match`, and `insert` re-adopts a request's device copy of pages cached on
the host. Each of these finds its victims in the index's per-tier heaps, so its cost follows
what it moves.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from mempool.address import MemType, block_of, decode, instance_of, mem_type_of
from mempool.allocator import BlockAllocator
from mempool.arena import Arena, HostArena, HugePages, make_arena
from mempool.errors import BlockInUse, InvalidAddress, InvalidRequest, MemPoolError, OutOfBlocks
from mempool.layout import KVBlockSpec, Layout
from mempool.radix import InsertResult, RadixTree, Tokens, TreeNode, token_array


class InsertFlags(IntFlag):
    NONE = 0
    LOCK = 1  # keep the inserted prefix locked: the request is still running (chunked prefill)
    KEEP_DUPLICATES = 2  # do not free given blocks whose pages were cached already


@dataclass(slots=True)
class Moved:
    """One index node's pages that changed tier (swap) or got a new home: their token ids
    and their block addresses before and after, page by page."""

    tokens: array[int]
    old: list[int]
    new: list[int]


@dataclass(slots=True)
class PrefixMatch:
    """What `match` found: block addresses of the cached prefix (blocks_per_page per page)."""

    addrs: list[int]
    num_tokens: int
    node: TreeNode
    locked: bool


class MemPool:
    """Blocks on the host tier (and a device tier when asked) plus the radix index over them.

    `reserve=False` maps the host arena with MAP_NORESERVE: capacity is virtual until blocks
    are written, so many simulated instances can model GPU-sized caches on one machine.
    """

    def __init__(
        self,
        instance_id: int,
        spec: KVBlockSpec,
        host_blocks: int,
        device_blocks: int = 0,
        layout: Layout | str = Layout.AGGREGATED,
        huge_pages: HugePages = "auto",
        clock: Callable[[], float] = time.monotonic,
        reserve: bool = True,
    ) -> None:
        self.instance_id = instance_id
        self.spec = spec
        self.layout = Layout.parse(layout)
        self.block_size = spec.block_size(self.layout)
        self.blocks_per_page = spec.blocks_per_page(self.layout)
        self.arenas: dict[MemType, Arena] = {}
        self.allocators: dict[MemType, BlockAllocator] = {}
        for mem_type, count in ((MemType.HOST, host_blocks), (MemType.DEVICE, device_blocks)):
            if count:
                self.arenas[mem_type] = make_arena(
                    mem_type, count, self.block_size, huge_pages, reserve
                )
                self.allocators[mem_type] = BlockAllocator(instance_id, mem_type, count)
        if not self.allocators:
            raise InvalidRequest("a MemPool needs host_blocks or device_blocks > 0")
        self._by_type = {int(t): a for t, a in self.allocators.items()}
        # Two tiers: index nodes carry their tier; one tier: every node keeps tier 0.
        self.tiered = len(self.allocators) == 2
        self.index = RadixTree(spec.page_size, self.blocks_per_page, clock)
        self._indexed: set[int] = set()

    # ----------------------------------------------------------------- memory API

    def alloc_mem(
        self, size: int, mem_type: MemType | str = MemType.HOST, instance_id: int | None = None
    ) -> list[int]:
        """Allocate blocks covering `size` bytes, all or nothing; returns their addresses."""
        if instance_id is not None and instance_id != self.instance_id:
            raise InvalidRequest(
                f"alloc_mem on instance {instance_id}, but this pool is instance "
                f"{self.instance_id}; memory on a peer is allocated by transfer"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidRequest(f"size must be a positive number of bytes, got {size!r}")
        allocator = self._allocator(mem_type)
        count = -(-size // self.block_size)
        if count > allocator.num_blocks:
            raise InvalidRequest(
                f"size {size} bytes needs {count} blocks of {self.block_size}; the "
                f"{allocator.mem_type.name.lower()} arena has only {allocator.num_blocks}"
            )
        return allocator.alloc(count)

    def alloc_blocks(self, count: int, mem_type: MemType | str = MemType.HOST) -> list[int]:
        """Allocate `count` blocks (the engine-side spelling of alloc_mem)."""
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise InvalidRequest(f"count must be a positive int, got {count!r}")
        return self.alloc_mem(count * self.block_size, mem_type)

    def free_mem(self, addrs: Sequence[int]) -> None:
        """Free blocks that are allocated and not indexed; all or nothing."""
        addrs = self._addr_list(addrs)
        if not self._indexed.isdisjoint(addrs):
            raise BlockInUse(
                "some blocks are in the prompt index; delete or evict the prompt instead"
            )
        self._free_blocks(addrs)

    def read_block(self, addr: int) -> bytes:
        """A copy of one allocated block's bytes."""
        arena, block = self._locate(addr)
        return arena.read(block)

    def write_block(self, addr: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one allocated block (exactly block_size bytes)."""
        arena, block = self._locate(addr)
        arena.write(block, data)

    def view_block(self, addr: int) -> memoryview:
        """Zero-copy view of a host (or emulated device) block."""
        arena, block = self._locate(addr)
        if not isinstance(arena, HostArena):
            raise InvalidRequest(f"block {addr:#x} lives in GPU memory; use read_block")
        return arena.view(block)

    def region(self, mem_type: MemType | str) -> memoryview:
        """Zero-copy view of a whole host (or emulated device) tier, for transports."""
        arena = self.arenas[self._allocator(mem_type).mem_type]
        if not isinstance(arena, HostArena):
            raise InvalidRequest(f"the {arena.mem_type.name.lower()} tier lives in GPU memory")
        return arena.region()

    def region_base(self, mem_type: MemType | str) -> int:
        """Virtual address of a tier's first byte (for RDMA / Mooncake registration)."""
        return self.arenas[self._allocator(mem_type).mem_type].base_address

    def is_indexed(self, addr: int) -> bool:
        """True when the block holds cached KV (the index owns it; never write into it)."""
        return addr in self._indexed

    def offset_of(self, addr: int) -> tuple[MemType, int]:
        """(tier, byte offset in its arena) of an allocated block: what a Segment names."""
        arena, block = self._locate(addr)
        return arena.mem_type, block * self.block_size

    # ----------------------------------------------------------------- index API

    def insert(
        self, tokens: Tokens, addrs: Sequence[int], flags: InsertFlags = InsertFlags.NONE
    ) -> InsertResult:
        """Index the whole pages of `tokens` to `addrs` (blocks_per_page per whole page).

        The pool takes ownership of the blocks: the ones it adopts become historical KV, and
        blocks given for pages already cached are freed (unless KEEP_DUPLICATES). Pass no
        block for a request's partial last page: it is never indexed and stays the caller's.
        """
        addrs = self._addr_list(addrs)
        if not self._owns(addrs):
            raise InvalidAddress("insert names blocks this pool has not allocated")
        if len(set(addrs)) != len(addrs):
            raise InvalidRequest("insert names the same block for two pages")
        clash = self._indexed.intersection(addrs)
        if clash:
            self._check_reinsert(tokens, addrs, clash)
        tier = 0
        if self.tiered:
            if not flags & InsertFlags.KEEP_DUPLICATES:
                self.promote(tokens, addrs)
            tier = mem_type_of(addrs[-1])
        result = self.index.insert(tokens, addrs, tier=tier)
        adopted = addrs[result.existing_tokens // self.spec.page_size * self.blocks_per_page :]
        self._indexed.update(adopted)
        if tier and adopted:
            self._split_by_tier(result.node, adopted)
        if result.duplicates and not flags & InsertFlags.KEEP_DUPLICATES:
            self._free_blocks(result.duplicates)
        if flags & InsertFlags.LOCK:
            self.index.lock(result.node)
        return result

    def match(self, tokens: Tokens, lock: bool = False) -> PrefixMatch:
        """Longest cached prefix of `tokens`: its block addresses; `lock` pins it until release."""
        found = self.index.match(tokens, split=lock)
        if lock:
            self.index.lock(found.node)
        return PrefixMatch(found.value.tolist(), found.num_tokens, found.node, lock)

    def release(self, target: PrefixMatch | InsertResult) -> None:
        """Unpin what `match(lock=True)` or `insert(flags=LOCK)` pinned."""
        if isinstance(target, PrefixMatch):
            if not target.locked:
                raise InvalidRequest("release of a match that is not locked (or released twice)")
            target.locked = False
        self.index.unlock(target.node)

    def delete(self, tokens: Tokens) -> list[int]:
        """Drop the cached pages only this prompt uses; returns the freed block addresses."""
        return self._release_indexed(self.index.delete(tokens))

    def evict(self, num_blocks: int, mem_type: MemType | str | None = None) -> list[int]:
        """Free at least `num_blocks` historical blocks, least recently used first.

        Returns the freed addresses (fewer than asked when the rest is locked), so a caller
        that publishes cache events can say which pages went. With two tiers, host leaves go
        first, then device pages with what hangs below them; `mem_type` limits it to the
        leaves of one tier.
        """
        bpp = self.blocks_per_page
        if not self.tiered:
            _, removed = self.index.evict(-(-num_blocks // bpp))
            return self._release_indexed(removed)
        if mem_type is None:
            order = [MemType.HOST, MemType.DEVICE]
        else:
            order = [self._allocator(mem_type).mem_type]
        freed: list[int] = []
        for tier in order:
            if len(freed) >= num_blocks:
                break
            _, removed = self.index.evict(-(-(num_blocks - len(freed)) // bpp), int(tier))
            freed += self._release_indexed(removed)
        return freed

    def flush(self) -> list[int]:
        """Drop the whole index; refused while a running request holds a lock."""
        if self.index.protected_pages:
            raise BlockInUse(f"{self.index.protected_pages} pages are locked by running requests")
        return self._release_indexed(self.index.reset())

    # ----------------------------------------------------------------- tiers

    def swap_out(self, num_blocks: int) -> list[int]:
        """Move `num_blocks` least-recently-used historical blocks device -> host.

        Returns the new host addresses; the index follows. Fewer only when fewer unlocked
        device blocks are cached; OutOfBlocks (nothing moved) when the host tier lacks room.
        """
        return [a for run in self.swap_out_runs(num_blocks) for a in run.new]

    def swap_out_runs(self, num_blocks: int) -> list[Moved]:
        """`swap_out`, saying which pages moved: whole index nodes, leaves before parents."""
        self._need_tiers()
        device, host = int(MemType.DEVICE), int(MemType.HOST)
        bpp = self.blocks_per_page
        want = -(-num_blocks // bpp) * bpp
        if num_blocks <= 0 or self.index.lru_leaf(device) is None:
            return []
        if self.allocators[MemType.HOST].num_free < want:
            raise OutOfBlocks(
                f"swap_out of {want} blocks: the host tier has "
                f"{self.allocators[MemType.HOST].num_free} free"
            )
        runs: list[Moved] = []
        moved = 0
        while moved < want:
            node = self.index.lru_leaf(device)
            if node is None:
                break
            assert node.value is not None
            pages, need = len(node.value) // bpp, (want - moved) // bpp
            if pages > need:
                self.index.split(node, pages - need)  # `node` keeps its last `need` pages
            runs.append(self._retier(node, MemType.HOST))
            moved += len(runs[-1].new)
        assert all(mem_type_of(a) == host for run in runs for a in run.new)
        return runs

    def swap_in(self, addrs: Sequence[int]) -> list[int]:
        """Move these host blocks to the device tier; returns new addresses in the same order.

        The index is searched whole for them; `swap_in_match` moves a match's pages at the
        cost of its path.
        """
        if MemType.DEVICE not in self.allocators:
            raise InvalidRequest("swap_in needs a device tier")
        addrs = self._addr_list(addrs)
        host = int(MemType.HOST)
        if any(mem_type_of(a) != host for a in addrs) or not self._owns(addrs):
            raise InvalidAddress("swap_in takes allocated host blocks of this pool")
        new = self._copy(addrs, MemType.DEVICE)
        mapping = dict(zip(addrs, new, strict=True))
        moved_indexed = self._indexed.intersection(addrs)
        if moved_indexed:
            self.index.repoint({a: mapping[a] for a in moved_indexed})
            self._indexed.difference_update(moved_indexed)
            self._indexed.update(mapping[a] for a in moved_indexed)
            for node in self.index.nodes():  # nodes left wholly on the device change tier
                value = node.value
                if node.tier == host and value is not None and host not in map(mem_type_of, value):
                    self.index.set_tier(node, int(MemType.DEVICE))
        self._free_blocks(addrs)
        return new

    def swap_in_match(self, found: PrefixMatch) -> list[Moved]:
        """Bring a locked match's host pages to the device tier (they stay pinned by it).

        A host node that someone else also holds locked (a peer reading it, a pull in
        flight) keeps its blocks: the match is cut before it (`found.addrs` and `num_tokens`
        shrink), so its reader never sees them move. OutOfBlocks (nothing moved) when the
        device tier lacks room for the rest.
        """
        if not found.locked:
            raise InvalidRequest("swap_in_match needs a locked match")
        if not self.tiered:
            return []
        host = int(MemType.HOST)
        path: list[TreeNode] = []
        node = found.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        load: list[TreeNode] = []
        keep = len(path)
        for i, step in enumerate(path):
            if step.tier == host:
                if step.lock_ref > 1:
                    keep = i
                    break
                load.append(step)
        count = sum(len(n.value) for n in load if n.value is not None)
        free = self.allocators[MemType.DEVICE].num_free
        if count > free:
            raise OutOfBlocks(f"swap_in of {count} blocks: the device tier has {free} free")
        runs = [self._retier(n, MemType.DEVICE) for n in load]
        found.addrs = [a for n in path[:keep] if n.value is not None for a in n.value]
        found.num_tokens = len(found.addrs) // self.blocks_per_page * self.spec.page_size
        return runs

    def promote(self, tokens: Tokens, addrs: Sequence[int]) -> list[Moved]:
        """Pages of `tokens` cached on the host whose device copy `addrs` names (a request
        recomputed them) take those device blocks; their host blocks are freed.

        `insert` does this itself; an engine calls it first to learn which pages moved.
        Locked host nodes and given blocks that are not free-standing device blocks are left
        alone (the given ones are then duplicates, freed by `insert`).
        """
        if not self.tiered:
            return []
        tokens = token_array(tokens)
        addrs = self._addr_list(addrs)
        bpp, host, device = self.blocks_per_page, int(MemType.HOST), int(MemType.DEVICE)
        if len(addrs) != len(tokens) // self.spec.page_size * bpp:
            return []  # insert refuses it, naming the problem
        path: list[TreeNode] = []
        node = self.index.match(tokens).node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        if not any(n.tier == host for n in path):
            return []
        node = self.index.match(tokens, split=True).node  # whole nodes along the prompt
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        runs: list[Moved] = []
        pos = 0
        for step in path:
            assert step.value is not None
            span = len(step.value)
            given = addrs[pos : pos + span]
            pos += span
            if (
                step.tier != host
                or step.lock_ref
                or any(mem_type_of(a) != device for a in given)
                or not self._indexed.isdisjoint(given)
                or not self._owns(given)
            ):
                continue
            old = step.value.tolist()
            step.value = array("Q", given)
            self.index.set_tier(step, device)
            self._indexed.difference_update(old)
            self._indexed.update(given)
            self._free_blocks(old)
            runs.append(Moved(array("I", step.key), old, list(given)))
        return runs

    # ----------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any]:
        tiers = {
            t.name.lower(): {
                "blocks": a.num_blocks,
                "free": a.num_free,
                "used": a.num_used,
                "block_bytes": self.block_size,
                "backing": self.arenas[t].backing,
            }
            for t, a in self.allocators.items()
        }
        return {
            "instance_id": self.instance_id,
            "layout": self.layout.value,
            "page_size": self.spec.page_size,
            "tiers": tiers,
            "cached_tokens": self.index.num_pages * self.spec.page_size,
            "evictable_pages": self.index.evictable_pages,
            "protected_pages": self.index.protected_pages,
        }

    def close(self) -> None:
        """Unmap every tier; MemPoolError (tier left usable) while block views are alive."""
        errors = []
        for arena in self.arenas.values():
            try:
                arena.close()
            except MemPoolError as exc:
                errors.append(str(exc))
        if errors:
            raise MemPoolError("; ".join(errors))

    # ----------------------------------------------------------------- helpers

    def _allocator(self, mem_type: MemType | str) -> BlockAllocator:
        try:
            parsed = MemType.parse(mem_type)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        allocator = self.allocators.get(parsed)
        if allocator is None:
            raise InvalidRequest(f"this pool has no {parsed.name.lower()} tier")
        return allocator

    def _addr_list(self, addrs: Sequence[int]) -> list[int]:
        if isinstance(addrs, int | str | bytes):
            raise InvalidRequest(f"expected a list of addresses, got {type(addrs).__name__}")
        addrs = list(addrs)
        if not addrs:
            raise InvalidRequest("the address list is empty")
        return addrs

    def _tier_of(self, addr: int) -> BlockAllocator | None:
        """The allocator an address would belong to here, or None if it names another owner."""
        if not isinstance(addr, int) or instance_of(addr) != self.instance_id:
            return None
        return self._by_type.get(mem_type_of(addr))

    def _owns(self, addrs: list[int]) -> bool:
        first = self._tier_of(addrs[0])
        if first is not None and first.owns(addrs):
            return True
        return all((t := self._tier_of(a)) is not None and t.owns((a,)) for a in addrs)

    def _free_blocks(self, addrs: list[int]) -> None:
        """Free a list that may span tiers: every part is validated before any is freed."""
        first = self._tier_of(addrs[0])
        if first is not None and first.try_free(addrs):
            return  # the common case: every block of one tier, each named once
        groups: dict[BlockAllocator, list[int]] = {}
        for addr in addrs:
            tier = self._tier_of(addr)
            if tier is None:
                raise InvalidAddress(self._explain_foreign(addr))
            groups.setdefault(tier, []).append(addr)
        for tier, part in groups.items():
            if not tier.owns(part) or len(set(part)) != len(part):
                tier.free(part)  # raises, naming the bad address; nothing was freed yet
        for tier, part in groups.items():
            tier.free(part)

    def _explain_foreign(self, addr: int) -> str:
        try:
            inst, mem_type, _ = decode(addr)  # raises for what is not an address at all
        except ValueError as exc:
            return str(exc)
        if inst != self.instance_id:
            return f"address {addr:#x} belongs to instance {inst}, not {self.instance_id}"
        return f"address {addr:#x} names the {mem_type.name.lower()} tier, which this pool lacks"

    def _release_indexed(self, removed: array[int]) -> list[int]:
        """Free blocks the index let go of (evicted, deleted, flushed); returns them."""
        blocks = removed.tolist()
        if not blocks:
            return blocks
        indexed = self._indexed
        before = len(indexed)
        indexed.difference_update(blocks)
        if before - len(indexed) == len(blocks) and len(self._by_type) == 1:
            # All were indexed, so allocated here, each once; one tier: no second check.
            next(iter(self._by_type.values())).free_known(blocks)
        else:
            self._free_blocks(blocks)  # blocks on two tiers: grouped and checked
        return blocks

    def _check_reinsert(self, tokens: Tokens, addrs: list[int], clash: set[int]) -> None:
        """Indexed blocks may only be given again for the very pages that hold them."""
        cached = self.index.match(tokens).value.tolist()
        n = len(cached)
        if addrs[:n] == cached and clash.isdisjoint(addrs[n:]):
            return  # the usual case: a finished request re-inserts its matched prefix
        for i, addr in enumerate(addrs):
            if addr in clash and (i >= n or cached[i] != addr):
                raise BlockInUse(
                    f"block {addr:#x} already caches other tokens; it cannot index position {i}"
                )

    def _locate(self, addr: int) -> tuple[Arena, int]:
        tier = self._tier_of(addr)
        if tier is None or not tier.owns((addr,)):
            raise InvalidAddress(f"address {addr!r} is not an allocated block of this pool")
        return self.arenas[tier.mem_type], block_of(addr)

    def _copy(self, addrs: list[int], to: MemType) -> list[int]:
        """Fresh blocks on tier `to` holding copies of `addrs`' bytes (OutOfBlocks: none)."""
        new = self.allocators[to].alloc(len(addrs))
        for old, fresh in zip(addrs, new, strict=True):
            src, sblock = self._locate(old)
            dst, dblock = self._locate(fresh)
            dst.write(dblock, src.view(sblock) if isinstance(src, HostArena) else src.read(sblock))
        return new

    def _retier(self, node: TreeNode, to: MemType) -> Moved:
        """Move one index node's blocks to tier `to`: copy, repoint, free the old blocks."""
        assert node.value is not None
        old = node.value.tolist()
        new = self._copy(old, to)
        node.value = array("Q", new)
        self.index.set_tier(node, int(to))
        self._indexed.difference_update(old)
        self._indexed.update(new)
        self._free_blocks(old)
        return Moved(array("I", node.key), old, new)

    def _split_by_tier(self, leaf: TreeNode, adopted: list[int]) -> None:
        """A new leaf whose blocks span tiers becomes one node per run of one tier."""
        tiers = [mem_type_of(a) for a in adopted[:: self.blocks_per_page]]
        node = leaf
        start = 0
        for i in range(1, len(tiers) + 1):
            if i < len(tiers) and tiers[i] == tiers[start]:
                continue
            if i < len(tiers):  # a run ends at page i: cut it off the top of what is left
                self.index.set_tier(self.index.split(node, i - start), tiers[start])
            else:
                self.index.set_tier(node, tiers[start])
            start = i

    def _need_tiers(self) -> None:
        if not self.tiered:
            raise InvalidRequest("swap needs both a device and a host tier")
