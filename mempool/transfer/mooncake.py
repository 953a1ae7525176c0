"""Mooncake's transfer engine as a MemPool transport (PyPI mooncake-transfer-engine-non-cuda).

Mooncake (FAST'25) moves KV cache with its own engine: registered memory, batches of
(local address, remote address, length), RDMA in production and TCP where no NIC exists.
Wrapping it gives MemPool a second production-grade data plane and gives the benchmark a
reference to measure our TCP transport against. Peers find each other by segment name
`host:rpc_port` with P2P handshake metadata, so no metadata server is needed.

The engine's calls block until the whole batch is done (and spin a core while they wait),
so they run in a worker thread; the engine releases the GIL.

Mooncake binds its handshake and TCP data listeners to every interface (INADDR_ANY, not
configurable in 0.3.x). `enter_private_network()` moves a process into a fresh network
namespace whose only interface is loopback; our tests and benchmark run Mooncake there, so
nothing they start is reachable from outside the machine.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from mempool.pool import MemPool
from mempool.transfer.base import DataTransport, PeerInfo, Region, Segment, TransferFailed
from mempool.transfer.rdma import coalesce

NAME = "mooncake"
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


class MooncakeUnavailable(RuntimeError):
    """The mooncake package is missing or its engine would not start."""


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """How the engine starts. `protocol` "rdma" needs `device` (NIC names) and a NIC."""

    hostname: str = "127.0.0.1"  # the address peers reach this engine at
    protocol: str = "tcp"
    device: str = ""
    merge: bool = True  # join segments contiguous on both sides into one batch entry
    # Entries per engine call. Mooncake 0.3.13's TCP transport fails (-1, nothing logged) a
    # batch of more than about 2,048 entries to one peer: its per-peer queues hold 1,024
    # transfers plus 1,024 waiting admission. Larger requests go as several batches.
    max_batch: int = 1024
    timeout: float = 120.0  # our guard; Mooncake's own is 30 s plus 1 s per GiB


def load_engine() -> type:
    """Mooncake's TransferEngine class, with its logging cut to errors."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeUnavailable(
            "mooncake is not importable: pip install mooncake-transfer-engine-non-cuda "
            f"(needs Debian libibverbs1, libnuma1, libcurl4): {exc}"
        ) from exc
    engine: type = TransferEngine  # the library is untyped
    return engine


class MooncakeTransport(DataTransport):
    """Batches of one-sided reads and writes through Mooncake's transfer engine."""

    name: ClassVar[str] = NAME

    def __init__(
        self,
        pool: MemPool,
        config: MooncakeConfig | None = None,
        engine_factory: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.config = config or MooncakeConfig()
        self._factory = engine_factory or load_engine()
        self.engine: Any = None
        self.segment = ""
        self.regions: tuple[Region, ...] = ()
        self._bases: dict[int, tuple[int, int]] = {}  # mem_type -> (base, length)
        self._closed = False

    async def start(self) -> dict[str, Any]:
        """Start the engine, register every tier once; the segment name peers address."""
        if self.engine is None:
            engine = self._factory()
            cfg = self.config
            rc = engine.initialize(cfg.hostname, "P2PHANDSHAKE", cfg.protocol, cfg.device)
            if rc != 0:
                raise MooncakeUnavailable(
                    f"Mooncake's engine did not start on {cfg.hostname} over {cfg.protocol} "
                    f"(return code {rc})"
                )
            regions = []
            for mem_type, arena in sorted(self.pool.arenas.items()):
                base = self.pool.region_base(mem_type)
                length = arena.num_blocks * arena.block_size
                if engine.register_memory(base, length) != 0:
                    raise MooncakeUnavailable(f"Mooncake refused to register {length} bytes")
                self._bases[int(mem_type)] = (base, length)
                regions.append(Region(int(mem_type), base, length))
            self.engine = engine
            self.regions = tuple(regions)
            self.segment = f"{cfg.hostname}:{engine.get_rpc_port()}"
        return {
            "segment": self.segment,
            "regions": [
                {"mem_type": r.mem_type, "base": r.base, "length": r.length} for r in self.regions
            ],
        }

    async def connect(self, peer: PeerInfo) -> None:
        """Nothing to do ahead: the engine opens the peer's segment on first use."""
        self._segment_of(peer)

    async def write(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._transfer(peer, segments, push=True)

    async def read(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._transfer(peer, segments, push=False)

    async def _transfer(self, peer: PeerInfo, segments: Sequence[Segment], push: bool) -> int:
        if self._closed or self.engine is None:
            raise TransferFailed("mooncake: transport is not started or already closed")
        if not segments:
            return 0
        target = self._segment_of(peer)
        remote = self._remote_bases(peer)
        local_addrs: list[int] = []
        remote_addrs: list[int] = []
        lengths: list[int] = []
        for seg in coalesce(segments) if self.config.merge else segments:
            local_type, local_off, remote_type, remote_off = (
                (seg.src_type, seg.src_offset, seg.dst_type, seg.dst_offset)
                if push
                else (seg.dst_type, seg.dst_offset, seg.src_type, seg.src_offset)
            )
            local_addrs.append(self._address(self._bases, local_type, local_off, seg, "local"))
            where = f"instance {peer.instance_id}"
            remote_addrs.append(self._address(remote, remote_type, remote_off, seg, where))
            lengths.append(seg.length)
        call = (
            self.engine.batch_transfer_sync_write if push else self.engine.batch_transfer_sync_read
        )
        self.calls += len(lengths)
        verb = "write to" if push else "read from"
        step = max(1, self.config.max_batch)

        def run() -> int:  # one thread hop for the whole request, batch after batch
            for i in range(0, len(lengths), step):
                j = i + step
                rc: int = call(target, local_addrs[i:j], remote_addrs[i:j], lengths[i:j])
                if rc != 0:
                    return rc
            return 0

        try:
            rc = await asyncio.wait_for(asyncio.to_thread(run), self.config.timeout)
        except TimeoutError as exc:
            raise TransferFailed(
                f"mooncake: {verb} instance {peer.instance_id} ({target}) timed out after "
                f"{self.config.timeout:g} s"
            ) from exc
        if rc != 0:
            raise TransferFailed(
                f"mooncake: {verb} instance {peer.instance_id} ({target}) failed with return "
                f"code {rc} ({len(lengths)} entries, {sum(lengths)} bytes): peer gone, "
                "unreachable or refusing the addresses"
            )
        return sum(lengths)

    @staticmethod
    def _address(
        bases: dict[int, tuple[int, int]], mem_type: int, offset: int, seg: Segment, where: str
    ) -> int:
        if mem_type not in bases:
            raise TransferFailed(f"mooncake: {where} has no registered tier {mem_type} for {seg}")
        base, length = bases[mem_type]
        if seg.length <= 0 or offset < 0 or offset + seg.length > length:
            raise TransferFailed(f"mooncake: {seg} runs past the tier {mem_type} arena of {where}")
        return base + offset

    def _segment_of(self, peer: PeerInfo) -> str:
        segment = peer.endpoints.get(NAME, {}).get("segment")
        if not segment:
            raise TransferFailed(f"mooncake: instance {peer.instance_id} publishes no segment")
        return str(segment)

    def _remote_bases(self, peer: PeerInfo) -> dict[int, tuple[int, int]]:
        listed = peer.endpoints.get(NAME, {}).get("regions")
        if listed:
            return {int(r["mem_type"]): (int(r["base"]), int(r["length"])) for r in listed}
        return {r.mem_type: (r.base, r.length) for r in peer.regions}

    async def close(self) -> None:
        """Unregister the arenas and drop the engine (its destructor stops its threads)."""
        if self._closed:
            return
        self._closed = True
        engine, self.engine = self.engine, None
        if engine is not None:
            for base, _ in self._bases.values():
                engine.unregister_memory(base)
        self._bases.clear()


def enter_private_network() -> None:
    """Move this process into a new network namespace with only loopback, brought up.

    Call it before the process starts threads: only the calling thread moves, and threads it
    starts later follow it. Needs root (or unprivileged user namespaces); raises OSError
    otherwise.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        first = ctypes.get_errno()
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            code = ctypes.get_errno() or first or errno.EPERM
            raise OSError(code, f"cannot make a private network namespace: {os.strerror(code)}")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def network_namespace() -> int:
    """Inode of this thread's network namespace (tests check isolation with it)."""
    return os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net").st_ino
