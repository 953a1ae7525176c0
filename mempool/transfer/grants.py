"""Which blocks each peer may write or read right now: the receiver-side guard on the data plane.

A transport that accepts one-sided writes and reads would otherwise let any authenticated peer
touch any byte of the arena. The control plane grants exactly the blocks it allocated (or
locked) for a peer's transfer and revokes them when the transfer ends, so a stray or late
write cannot land in blocks that now belong to another request or to the index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

# (peer instance id, "write" | "read", memory type, byte offset, length) -> None or a refusal
AccessCheck = Callable[[int, str, int, int, int], str | None]


class Grants:
    """Reference-counted (peer, op, tier, block) grants; `check` is an AccessCheck."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._granted: dict[tuple[int, str], Counter[tuple[int, int]]] = {}

    def grant(self, peer: int, op: str, locations: Iterable[tuple[int, int]]) -> None:
        counter = self._granted.setdefault((peer, op), Counter())
        bs = self.block_size
        counter.update((mem_type, offset // bs) for mem_type, offset in locations)

    def revoke(self, peer: int, op: str, locations: Iterable[tuple[int, int]]) -> None:
        counter = self._granted.get((peer, op))
        if counter is None:
            return
        bs = self.block_size
        counter.subtract((mem_type, offset // bs) for mem_type, offset in locations)
        for key in [k for k, v in counter.items() if v <= 0]:
            del counter[key]
        if not counter:
            del self._granted[(peer, op)]

    def revoke_peer(self, peer: int) -> None:
        for key in [k for k in self._granted if k[0] == peer]:
            del self._granted[key]

    def check(self, peer: int, op: str, mem_type: int, offset: int, length: int) -> str | None:
        counter = self._granted.get((peer, op))
        first, last = offset // self.block_size, (offset + length - 1) // self.block_size
        if counter is not None and all((mem_type, b) in counter for b in range(first, last + 1)):
            return None
        return (
            f"instance {peer} may not {op} bytes [{offset}, {offset + length}) of tier "
            f"{mem_type}: no transfer of it holds those blocks"
        )

    @property
    def empty(self) -> bool:
        return not self._granted


def allow_all(peer: int, op: str, mem_type: int, offset: int, length: int) -> str | None:
    """The data plane on its own (benchmarks): bounds are checked, ownership is not."""
    return None
