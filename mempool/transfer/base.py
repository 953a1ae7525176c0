"""The data-plane contract every transport meets: move byte ranges between registered arenas.

The control plane (who allocates, what gets inserted, acknowledgements) is the same for every
transport; only the movement of bytes differs. A transport sees each instance's arenas as
registered regions and copies `Segment`s between them: one-sided writes (push, the sender's
side of MemServe's transfer) and reads (pull, KVDirect's protocol). RDMA and Mooncake do this
in hardware or their own engine; TCP and the same-host path emulate it in software.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Region:
    """One registered arena (one MemPool tier) as a peer addresses it."""

    mem_type: int  # mempool.address.MemType value
    base: int  # virtual address of the arena's first byte
    length: int  # bytes
    rkey: int = 0  # RDMA remote key of the registration; 0 for other transports


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """How to reach an instance: what membership publishes and the control plane exchanges."""

    instance_id: int
    host: str
    port: int  # the instance's TCP control (and TCP data) port
    regions: tuple[Region, ...] = ()
    # Per transport name, what a peer needs to connect (RDMA: gid/qpn/psn; Mooncake:
    # its segment name). Exchanged over the TCP control channel.
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Segment:
    """`length` bytes at `src_offset` of tier `src_type` to `dst_offset` of tier `dst_type`.

    Offsets are byte offsets into the arenas (block index * block size + offset in block),
    so adjacent blocks are adjacent bytes and can be merged into one call.
    """

    src_type: int
    src_offset: int
    dst_type: int
    dst_offset: int
    length: int


def merge_segments(
    segments: Sequence[Segment], block_sizes: tuple[int, int] | None = None
) -> list[Segment]:
    """Join runs that are contiguous on both sides (KVDirect's merging), keeping the order.

    With `block_sizes` (source, destination), a run never crosses a block boundary on either
    side: one call per block, as an engine without merging issues them.
    """
    out: list[Segment] = []
    for seg in segments:
        if out:
            last = out[-1]
            if (
                last.src_type == seg.src_type
                and last.dst_type == seg.dst_type
                and last.src_offset + last.length == seg.src_offset
                and last.dst_offset + last.length == seg.dst_offset
                and (block_sizes is None or _same_blocks(last, seg, *block_sizes))
            ):
                out[-1] = Segment(
                    last.src_type,
                    last.src_offset,
                    last.dst_type,
                    last.dst_offset,
                    last.length + seg.length,
                )
                continue
        out.append(seg)
    return out


def _same_blocks(last: Segment, seg: Segment, src_block: int, dst_block: int) -> bool:
    """`seg` ends in the blocks where `last` starts, on both sides."""
    return (
        last.src_offset // src_block == (seg.src_offset + seg.length - 1) // src_block
        and last.dst_offset // dst_block == (seg.dst_offset + seg.length - 1) // dst_block
    )


# The control plane's way to hand an offer to the peer's `accept` and bring back its answer.
Exchange = Callable[["PeerInfo", dict[str, Any]], Awaitable[dict[str, Any]]]


@runtime_checkable
class OfferExchanging(Protocol):
    """A transport that trades connection offers over the control connection (RDMA).

    The agent fills `exchange` in when the transport was made without one.
    """

    exchange: Exchange | None


class TransferFailed(Exception):
    """A transfer that could not complete: peer gone, timed out, refused or corrupted."""


class DataTransport(ABC):
    """Moves bytes between this instance's arenas and a peer's. One per instance and kind.

    `write` copies local bytes (src) into the peer's arenas (dst); `read` copies the peer's
    bytes (src) into local arenas (dst). Both return the bytes moved and raise
    TransferFailed with a message naming the peer on any failure. `calls` counts the
    network operations issued (work requests, frames, batch entries), the figure merging and
    aggregation reduce.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    async def start(self) -> dict[str, Any]:
        """Register the local arenas; the endpoint data peers need (PeerInfo.endpoints)."""

    @abstractmethod
    async def connect(self, peer: PeerInfo) -> None:
        """Prepare to move bytes to and from `peer` (idempotent)."""

    @abstractmethod
    async def write(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        """Push local bytes into the peer's arenas."""

    @abstractmethod
    async def read(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        """Pull the peer's bytes into local arenas."""

    async def disconnect(self, peer_id: int) -> None:  # noqa: B027 - optional
        """Forget a peer (it left or died); in-flight operations to it fail."""

    @abstractmethod
    async def close(self) -> None:
        """Release registrations, sockets and queues."""
