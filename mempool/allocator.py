"""Fixed-size block allocation over one arena: a free stack of ready-made addresses.

Addresses are precomputed, so alloc and free are slice and set operations done in C; a
whole request is allocated all-or-nothing (KVDirect: partial allocation deadlocks).
"""

from __future__ import annotations

from collections.abc import Iterable

from mempool.address import MemType, decode, encode
from mempool.errors import InvalidAddress, OutOfBlocks


class BlockAllocator:
    """Hands out block addresses of one tier of one instance; rejects double and foreign frees."""

    def __init__(self, instance: int, mem_type: MemType, num_blocks: int) -> None:
        self.instance = instance
        self.mem_type = mem_type
        self.num_blocks = num_blocks
        first = encode(instance, mem_type, 0)
        # Reversed so that pops from the end hand out low block numbers first.
        self._free: list[int] = list(range(first + num_blocks - 1, first - 1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def alloc(self, count: int) -> list[int]:
        """`count` addresses, or OutOfBlocks with nothing taken."""
        free = self._free
        if count > len(free):
            raise OutOfBlocks(
                f"{self.mem_type.name.lower()} tier of instance {self.instance}: "
                f"{count} blocks requested, {len(free)} free of {self.num_blocks}"
            )
        addrs = free[: -count - 1 : -1] if count else []  # top of the stack first: ascending
        del free[len(free) - count :]
        self._allocated.update(addrs)
        return addrs

    def free(self, addrs: list[int]) -> None:
        """Return blocks; any bad address rejects the whole call and frees nothing."""
        if not self.try_free(addrs):
            raise InvalidAddress(self._explain(addrs))

    def try_free(self, addrs: list[int]) -> bool:
        """Free and return True, or return False with nothing freed (a bad or repeated address)."""
        allocated = self._allocated
        if not allocated.issuperset(addrs):
            return False
        before = len(allocated)
        allocated.difference_update(addrs)
        if len(allocated) != before - len(addrs):  # an address was named twice: undo
            allocated.update(addrs)
            return False
        self._free.extend(reversed(addrs))  # a freed run comes back out in the same order
        return True

    def free_known(self, addrs: list[int]) -> None:
        """Return blocks the caller knows are allocated here, each named once (the index's).

        One set pass where `try_free` needs two: eviction frees whole nodes of blocks on the
        path of an allocation that fell short. The caller has checked the list already.
        """
        self._allocated.difference_update(addrs)
        self._free.extend(reversed(addrs))

    def owns(self, addrs: Iterable[int]) -> bool:
        """True when every address is currently allocated here."""
        return self._allocated.issuperset(addrs)

    def _explain(self, addrs: list[int]) -> str:
        seen: set[int] = set()
        for addr in addrs:
            try:
                inst, mem_type, block = decode(addr)
            except ValueError as exc:
                return str(exc)
            if inst != self.instance or mem_type is not self.mem_type:
                return (
                    f"address {addr:#x} belongs to instance {inst} {mem_type.name.lower()}, "
                    f"not instance {self.instance} {self.mem_type.name.lower()}"
                )
            if block >= self.num_blocks:
                return f"address {addr:#x}: block {block} beyond the arena's {self.num_blocks}"
            if addr in seen:
                return f"address {addr:#x} appears twice in one free"
            if addr not in self._allocated:
                return f"address {addr:#x} is not allocated (double free?)"
            seen.add(addr)
        return "invalid address list"
