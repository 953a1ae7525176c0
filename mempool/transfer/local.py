"""Same-process data plane: two pools in one process copy bytes region to region (one memcpy).

Instances register in a process-wide table on `start()`; a peer is reachable when its endpoint
names this process and an instance registered here. The destination's access check (the
control plane's grants) applies exactly as on the TCP path, so both transports refuse the same
writes and reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, ClassVar

from mempool.errors import InvalidRequest
from mempool.pool import MemPool
from mempool.transfer.base import DataTransport, PeerInfo, Segment, TransferFailed
from mempool.transfer.grants import AccessCheck, allow_all

_REGISTRY: dict[int, LocalTransport] = {}


class LocalTransport(DataTransport):
    """memcpy between the arenas of pools living in this process."""

    name: ClassVar[str] = "local"

    def __init__(self, pool: MemPool, access: AccessCheck = allow_all) -> None:
        super().__init__()
        self.pool = pool
        self.instance_id = pool.instance_id
        self.access = access
        self._regions: dict[int, memoryview] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    async def start(self) -> dict[str, Any]:
        other = _REGISTRY.get(self.instance_id)
        if other is not None and other is not self:
            raise InvalidRequest(
                f"instance {self.instance_id} is already registered for local transfers "
                "in this process"
            )
        for mem_type in self.pool.arenas:
            with contextlib.suppress(InvalidRequest):  # a GPU tier: not host-addressable
                self._regions[int(mem_type)] = self.pool.region(mem_type)
        _REGISTRY[self.instance_id] = self
        return {"pid": os.getpid(), "instance_id": self.instance_id}

    async def connect(self, peer: PeerInfo) -> None:
        self._peer(peer)

    def _peer(self, peer: PeerInfo) -> LocalTransport:
        endpoint = peer.endpoints.get(self.name) or {}
        other = _REGISTRY.get(peer.instance_id)
        if endpoint.get("pid") != os.getpid() or other is None:
            raise TransferFailed(
                f"local: instance {peer.instance_id} is not a pool of this process"
            )
        return other

    async def write(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        other = self._peer(peer)
        return self._copy(self, other, other, "write", segments)

    async def read(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        other = self._peer(peer)
        return self._copy(other, self, other, "read", segments)

    def _copy(
        self,
        src: LocalTransport,
        dst: LocalTransport,
        remote: LocalTransport,
        op: str,
        segments: Sequence[Segment],
    ) -> int:
        views = []
        for seg in segments:  # check everything before the first byte moves
            s = _slice(src, seg.src_type, seg.src_offset, seg.length)
            d = _slice(dst, seg.dst_type, seg.dst_offset, seg.length)
            mem_type, offset = (
                (seg.dst_type, seg.dst_offset) if op == "write" else (seg.src_type, seg.src_offset)
            )
            refusal = remote.access(self.instance_id, op, mem_type, offset, seg.length)
            if refusal:
                raise TransferFailed(f"local: instance {remote.instance_id} refused: {refusal}")
            views.append((d, s))
        total = 0
        for d, s in views:
            d[:] = s
            total += len(s)
        self.calls += len(segments)
        if op == "write":
            self.bytes_sent += total
        else:
            self.bytes_received += total
        return total

    async def close(self) -> None:
        if _REGISTRY.get(self.instance_id) is self:
            del _REGISTRY[self.instance_id]
        self._regions.clear()


def _slice(t: LocalTransport, mem_type: int, offset: int, length: int) -> memoryview:
    region = t._regions.get(mem_type)
    if region is None or length <= 0 or offset < 0 or offset + length > len(region):
        raise TransferFailed(
            f"local: bytes [{offset}, {offset + length}) outside tier {mem_type} of instance "
            f"{t.instance_id}"
        )
    return region[offset : offset + length]
