"""MemPool: one instance's KV memory (tiers of fixed-size blocks) and its prompt index.

The API keeps MemServe's names (Table 1): alloc_mem/free_mem, insert/match/delete,
swap_out/swap_in. Blocks a running request owns are *active*; `insert` turns them into
*historical* KV that later requests `match`, and that eviction or swapping may move once no
request holds a lock on it.
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
from mempool.errors import BlockInUse, InvalidAddress, InvalidRequest, MemPoolError
from mempool.layout import KVBlockSpec, Layout
from mempool.radix import InsertResult, RadixTree, Tokens, TreeNode, token_array


class InsertFlags(IntFlag):
    NONE = 0
    LOCK = 1  # keep the inserted prefix locked: the request is still running (chunked prefill)
    KEEP_DUPLICATES = 2  # do not free given blocks whose pages were cached already


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
        tokens = token_array(tokens)  # once: the reinsert check and the insert share it
        addrs = self._addr_list(addrs)
        if not self._owns(addrs):
            raise InvalidAddress("insert names blocks this pool has not allocated")
        if len(set(addrs)) != len(addrs):
            raise InvalidRequest("insert names the same block for two pages")
        clash = self._indexed.intersection(addrs)
        if clash:
            self._check_reinsert(tokens, addrs, clash)
        result = self.index.insert(tokens, addrs)
        adopted = addrs[result.existing_tokens // self.spec.page_size * self.blocks_per_page :]
        self._indexed.update(adopted)
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

    def evict(self, num_blocks: int) -> list[int]:
        """Free at least `num_blocks` historical blocks, least recently used first.

        Returns the freed addresses (fewer than asked when the rest is locked), so a caller
        that publishes cache events can say which pages went.
        """
        pages = -(-num_blocks // self.blocks_per_page)
        _, removed = self.index.evict(pages)
        return self._release_indexed(removed)

    def flush(self) -> list[int]:
        """Drop the whole index; refused while a running request holds a lock."""
        if self.index.protected_pages:
            raise BlockInUse(f"{self.index.protected_pages} pages are locked by running requests")
        return self._release_indexed(self.index.reset())

    # ----------------------------------------------------------------- tiers

    def swap_out(self, num_blocks: int) -> list[int]:
        """Move up to `num_blocks` least-recently-used historical blocks device -> host.

        Returns the new host addresses; the index follows. OutOfBlocks (nothing moved) when
        the host tier lacks room.
        """
        if MemType.DEVICE not in self.allocators or MemType.HOST not in self.allocators:
            raise InvalidRequest("swap needs both a device and a host tier")
        victims: list[int] = []
        sources: list[TreeNode] = []
        device = int(MemType.DEVICE)
        for node in self.index.lru_unlocked():  # eviction's order: LRU, suffixes first
            if node.value is None:
                continue
            found = [a for a in node.value if mem_type_of(a) == device]
            if found:
                victims.extend(found)
                sources.append(node)
                if len(victims) >= num_blocks:
                    break
        return self._move(victims[:num_blocks], MemType.HOST, sources)

    def swap_in(self, addrs: Sequence[int]) -> list[int]:
        """Move these host blocks to the device tier; returns new addresses in the same order."""
        if MemType.DEVICE not in self.allocators:
            raise InvalidRequest("swap_in needs a device tier")
        addrs = self._addr_list(addrs)
        host = int(MemType.HOST)
        if any(mem_type_of(a) != host for a in addrs) or not self._owns(addrs):
            raise InvalidAddress("swap_in takes allocated host blocks of this pool")
        return self._move(addrs, MemType.DEVICE)

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

    def _move(
        self, addrs: list[int], to: MemType, nodes: Sequence[TreeNode] | None = None
    ) -> list[int]:
        """Copy blocks to tier `to`, repoint the index, free the old blocks.

        `nodes`: the index nodes holding the indexed ones among `addrs`, when the caller
        knows them (swap_out); otherwise the index searches every node.
        """
        if not addrs:
            return []
        new = self.allocators[to].alloc(len(addrs))
        mapping = dict(zip(addrs, new, strict=True))
        for old, fresh in mapping.items():
            src, sblock = self._locate(old)
            dst, dblock = self._locate(fresh)
            dst.write(dblock, src.view(sblock) if isinstance(src, HostArena) else src.read(sblock))
        moved_indexed = self._indexed.intersection(addrs)
        if moved_indexed:
            self.index.repoint({a: mapping[a] for a in moved_indexed}, nodes)
            self._indexed.difference_update(moved_indexed)
            self._indexed.update(mapping[a] for a in moved_indexed)
        self._free_blocks(addrs)
        return new
