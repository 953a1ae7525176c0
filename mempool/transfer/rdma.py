"""RDMA transport over pyverbs: one-sided RDMA WRITE (push) and READ (pull) on RC queue pairs.

Each arena tier is registered once at start (one memory region, remote read and write
allowed), so a transfer costs no registration and no copy: the NIC moves bytes straight
between the two instances' arenas while neither CPU touches them. One reliable-connected
queue pair per peer; work requests are chained into one `post_send` per batch, only every
N-th is signaled (fewer completions to poll), and the number in flight never exceeds the
queue pair's depth. Completions are polled from the event loop with short sleeps, so a long
transfer never blocks other coroutines.

A queue pair needs its peer's queue pair number before it can be connected, so `connect`
sends an offer (this side's qpn, psn, lid, gid, mtu) through `exchange`, a coroutine the
control plane supplies, and the peer answers from `accept`. The static part (device, lid,
gid, registered regions with their rkeys) is in `start()`'s endpoint dict.

This transport has never run on an RDMA device: none exists on the machines it was written
on. Its logic runs in tests against an in-memory double of pyverbs
(tests/mempool/transfer/verbs_double.py); `pyverbs` itself is only checked to import.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

from mempool.address import MemType
from mempool.pool import MemPool
from mempool.transfer.base import (
    DataTransport,
    Exchange,
    PeerInfo,
    Region,
    Segment,
    TransferFailed,
    merge_segments,
)

NAME = "rdma"


class RdmaUnavailable(RuntimeError):
    """No usable RDMA stack or device here; callers choose another transport (TCP)."""


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """Knobs of the RDMA transport. Defaults suit a ConnectX-class NIC."""

    device: str | None = None  # None: the first device listed
    port: int = 1
    gid_index: int = 0
    qp_depth: int = 512  # send work requests in flight per queue pair (clamped to the device's)
    post_batch: int = 32  # work requests chained into one post_send
    signal_every: int = 16  # one signaled work request per this many (and each batch's last)
    max_wr_bytes: int = 1 << 30  # longer segments are split (RC messages stop at 2 GiB)
    timeout: float = 30.0  # seconds an operation may wait for its completions
    merge: bool = True  # join segments contiguous on both sides into one work request
    max_rd_atomic: int = 16  # outstanding RDMA READs per queue pair, before device limits


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs names this transport uses, as one object (the test double mimics it)."""
    try:
        import pyverbs.enums as enums
        from pyverbs import addr, cq, device, mr, pd, qp, wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        raise RdmaUnavailable(
            "pyverbs is not importable: install Debian's python3-pyverbs and run "
            f"scripts/install.sh, which links it into this interpreter ({exc})"
        ) from exc
    return SimpleNamespace(
        get_device_list=device.get_device_list,
        Context=device.Context,
        PD=pd.PD,
        MR=mr.MR,
        CQ=cq.CQ,
        QP=qp.QP,
        QPInitAttr=qp.QPInitAttr,
        QPCap=qp.QPCap,
        QPAttr=qp.QPAttr,
        AHAttr=addr.AHAttr,
        GlobalRoute=addr.GlobalRoute,
        GID=addr.GID,
        SGE=wr.SGE,
        SendWR=wr.SendWR,
        wc_status_str=cq.cqe_status_to_str,
        Error=PyverbsError,
        e=enums,
    )


def rdma_devices(verbs: Any = None) -> list[str]:
    """Names of the RDMA devices present; empty when there are none or no kernel support.

    Raises RdmaUnavailable only when pyverbs itself is missing.
    """
    verbs = verbs if verbs is not None else load_pyverbs()
    try:
        devices = verbs.get_device_list()
    except verbs.Error:  # libibverbs says "Failed to get devices list" without kernel support
        return []
    return [_text(d.name) for d in devices]


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


@dataclass(slots=True)
class _Group:
    """Work requests posted together up to one signaled one: its completion frees them all."""

    wr_id: int
    count: int


@dataclass(slots=True)
class _Connection:
    """One RC queue pair to a peer, its completion queue, and what is in flight on it."""

    peer_id: int
    qp: Any
    cq: Any
    depth: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    groups: deque[_Group] = field(default_factory=deque)
    outstanding: int = 0
    next_wr_id: int = 1
    broken: str | None = None  # why it can no longer be used (then it is destroyed)
    destroyed: bool = False

    def destroy(self) -> None:
        """Destroy the queue pair first: after that the NIC no longer touches our memory."""
        if self.destroyed:
            return
        self.destroyed = True
        for obj in (self.qp, self.cq):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


class RdmaTransport(DataTransport):
    """One-sided RDMA between MemPools: RDMA WRITE pushes, RDMA READ pulls.

    Opening the device happens here, so a machine without one fails at construction with
    RdmaUnavailable and the caller falls back to TCP. `verbs` replaces pyverbs (tests).
    """

    name: ClassVar[str] = NAME

    def __init__(
        self,
        pool: MemPool,
        config: RdmaConfig | None = None,
        exchange: Exchange | None = None,
        verbs: Any = None,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.config = config or RdmaConfig()
        self.exchange = exchange
        self.v = verbs if verbs is not None else load_pyverbs()
        self.device = self._pick_device()
        self.ctx = self.v.Context(name=self.device)
        self._port = self.ctx.query_port(self.config.port)
        if self._port.state != self.v.e.IBV_PORT_ACTIVE:
            raise RdmaUnavailable(
                f"RDMA device {self.device} port {self.config.port} is not active "
                f"(state {self._port.state})"
            )
        attr = self.ctx.query_device()
        self._depth = max(1, min(self.config.qp_depth, attr.max_qp_wr))
        self._rd_atomic = max(
            1, min(self.config.max_rd_atomic, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom)
        )
        self._gid = self.ctx.query_gid(self.config.port, self.config.gid_index).gid
        self.pd = self.v.PD(self.ctx)
        self._mrs: dict[int, Any] = {}
        self._local: dict[int, tuple[int, int, int]] = {}  # mem_type -> (base, length, lkey)
        self.regions: tuple[Region, ...] = ()
        self._conns: dict[int, _Connection] = {}
        self._passive: dict[int, list[_Connection]] = {}  # accepted pairs we do not drive
        self._connecting: dict[int, asyncio.Lock] = {}
        self._closed = False

    # ----------------------------------------------------------------- setup

    def _pick_device(self) -> str:
        names = rdma_devices(self.v)
        if not names:
            raise RdmaUnavailable(
                "no RDMA device found (libibverbs lists none; this kernel may lack "
                "InfiniBand/RoCE support): use the TCP transport"
            )
        wanted = self.config.device
        if wanted is None:
            return names[0]
        if wanted not in names:
            raise RdmaUnavailable(f"RDMA device {wanted!r} not found; present: {names}")
        return wanted

    async def start(self) -> dict[str, Any]:
        """Register every tier once (remote read and write); the endpoint peers need."""
        if not self._mrs:
            access = (
                self.v.e.IBV_ACCESS_LOCAL_WRITE
                | self.v.e.IBV_ACCESS_REMOTE_WRITE
                | self.v.e.IBV_ACCESS_REMOTE_READ
            )
            regions = []
            for mem_type, arena in sorted(self.pool.arenas.items()):
                base = self.pool.region_base(mem_type)
                length = arena.num_blocks * arena.block_size
                mr = self.v.MR(self.pd, length, access, address=base)
                self._mrs[int(mem_type)] = mr
                self._local[int(mem_type)] = (base, length, mr.lkey)
                regions.append(Region(int(mem_type), base, length, mr.rkey))
            self.regions = tuple(regions)
        return {
            "device": self.device,
            "port": self.config.port,
            "lid": self._port.lid,
            "gid": self._gid,
            "mtu": int(self._port.active_mtu),
            "regions": [
                {"mem_type": r.mem_type, "base": r.base, "length": r.length, "rkey": r.rkey}
                for r in self.regions
            ],
        }

    def _new_pair(self, peer_id: int) -> tuple[_Connection, dict[str, Any]]:
        """A queue pair in INIT state and the offer that describes it to the peer."""
        cq = self.v.CQ(self.ctx, self._depth, None, None, 0)
        cap = self.v.QPCap(max_send_wr=self._depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = self.v.QPInitAttr(qp_type=self.v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = self.v.QPAttr(port_num=self.config.port)
        attr.qp_access_flags = (
            self.v.e.IBV_ACCESS_LOCAL_WRITE
            | self.v.e.IBV_ACCESS_REMOTE_WRITE
            | self.v.e.IBV_ACCESS_REMOTE_READ
        )
        qp = self.v.QP(self.pd, init, attr)
        conn = _Connection(peer_id, qp, cq, self._depth)
        offer = {
            "instance_id": self.pool.instance_id,
            "qpn": qp.qp_num,
            "psn": random.getrandbits(24),
            "lid": self._port.lid,
            "gid": self._gid,
            "mtu": int(self._port.active_mtu),
            "rd_atomic": self._rd_atomic,
        }
        return conn, offer

    def _ready(self, conn: _Connection, mine: dict[str, Any], theirs: dict[str, Any]) -> None:
        """INIT -> RTR (pointed at the peer's queue pair) -> RTS."""
        v = self.v
        attr = v.QPAttr(port_num=self.config.port)
        attr.qp_access_flags = (
            v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_WRITE | v.e.IBV_ACCESS_REMOTE_READ
        )
        attr.path_mtu = min(mine["mtu"], int(theirs["mtu"]))
        attr.dest_qp_num = int(theirs["qpn"])
        attr.rq_psn = int(theirs["psn"])
        attr.sq_psn = mine["psn"]
        attr.max_dest_rd_atomic = self._rd_atomic
        attr.max_rd_atomic = max(1, min(self._rd_atomic, int(theirs["rd_atomic"])))
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        route = v.GlobalRoute(dgid=v.GID(theirs["gid"]), sgid_index=self.config.gid_index)
        attr.ah_attr = v.AHAttr(
            port_num=self.config.port, is_global=1, gr=route, dlid=int(theirs["lid"])
        )
        conn.qp.to_rtr(attr)
        conn.qp.to_rts(attr)

    async def connect(self, peer: PeerInfo) -> None:
        """Create a queue pair for `peer`, trade offers through the control plane, connect."""
        self._check_open()
        if self._usable(peer.instance_id):
            return
        lock = self._connecting.setdefault(peer.instance_id, asyncio.Lock())
        async with lock:
            if not self._usable(peer.instance_id):
                await self._handshake(peer)

    def _usable(self, peer_id: int) -> bool:
        conn = self._conns.get(peer_id)
        return conn is not None and conn.broken is None and not conn.destroyed

    async def _handshake(self, peer: PeerInfo) -> None:
        if self.exchange is None:
            raise TransferFailed(
                f"rdma: no control channel to trade queue pairs with instance {peer.instance_id}"
            )
        new, offer = self._new_pair(peer.instance_id)
        try:
            answer = await self.exchange(peer, offer)
            self._ready(new, offer, answer)
        except TransferFailed:
            new.destroy()
            raise
        except Exception as exc:
            new.destroy()
            raise TransferFailed(
                f"rdma: connecting to instance {peer.instance_id} ({peer.host}) failed: {exc}"
            ) from exc
        old = self._conns.get(peer.instance_id)
        if old is not None and not old.lock.locked():
            old.destroy()
        self._conns[peer.instance_id] = new

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        """The peer's side of `connect`: a queue pair connected to the offered one; its answer."""
        self._check_open()
        peer_id = int(offer["instance_id"])
        conn, answer = self._new_pair(peer_id)
        try:
            self._ready(conn, answer, offer)
        except Exception:
            conn.destroy()
            raise
        # A pair the peer drives; it also serves our own writes and reads until we connect.
        if not self._usable(peer_id):
            self._conns[peer_id] = conn
        else:
            self._passive.setdefault(peer_id, []).append(conn)
        return answer

    # ----------------------------------------------------------------- data path

    async def write(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._transfer(peer, segments, self.v.e.IBV_WR_RDMA_WRITE, "write")

    async def read(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._transfer(peer, segments, self.v.e.IBV_WR_RDMA_READ, "read")

    async def _transfer(
        self, peer: PeerInfo, segments: Sequence[Segment], opcode: int, verb: str
    ) -> int:
        self._check_open()
        if not segments:
            return 0
        pieces = self._work(peer, segments, verb == "write")
        await self.connect(peer)
        conn = self._conns[peer.instance_id]
        async with conn.lock:
            try:
                await self._post_all(conn, pieces, opcode, peer, verb)
            finally:
                if conn.broken is not None:
                    conn.destroy()
                    if self._conns.get(peer.instance_id) is conn:
                        del self._conns[peer.instance_id]
        return sum(p[2] for p in pieces)

    def _work(
        self, peer: PeerInfo, segments: Sequence[Segment], push: bool
    ) -> list[tuple[int, int, int, int, int]]:
        """(local addr, lkey, length, remote addr, rkey) per work request, bounds-checked."""
        remote = self._remote_regions(peer)
        segs = coalesce(segments) if self.config.merge else list(segments)
        out: list[tuple[int, int, int, int, int]] = []
        for seg in segs:
            if seg.length <= 0:
                raise TransferFailed(f"rdma: empty segment {seg} for instance {peer.instance_id}")
            local_type, local_off, remote_type, remote_off = (
                (seg.src_type, seg.src_offset, seg.dst_type, seg.dst_offset)
                if push
                else (seg.dst_type, seg.dst_offset, seg.src_type, seg.src_offset)
            )
            if local_type not in self._local:
                raise TransferFailed(
                    f"rdma: local tier {_tier(local_type)} is not registered (start() first?)"
                )
            base, length, lkey = self._local[local_type]
            if remote_type not in remote:
                raise TransferFailed(
                    f"rdma: instance {peer.instance_id} has no registered {_tier(remote_type)} tier"
                )
            rbase, rlength, rkey = remote[remote_type]
            if local_off < 0 or local_off + seg.length > length:
                raise TransferFailed(f"rdma: {seg} runs past the local {_tier(local_type)} arena")
            if remote_off < 0 or remote_off + seg.length > rlength:
                where = f"the {_tier(remote_type)} arena of instance {peer.instance_id}"
                raise TransferFailed(f"rdma: {seg} runs past {where}")
            step = self.config.max_wr_bytes
            for start in range(0, seg.length, step):
                n = min(step, seg.length - start)
                out.append((base + local_off + start, lkey, n, rbase + remote_off + start, rkey))
        return out

    def _remote_regions(self, peer: PeerInfo) -> dict[int, tuple[int, int, int]]:
        endpoint = peer.endpoints.get(NAME, {})
        listed = endpoint.get("regions")
        if listed:
            return {
                int(r["mem_type"]): (int(r["base"]), int(r["length"]), int(r["rkey"]))
                for r in listed
            }
        return {r.mem_type: (r.base, r.length, r.rkey) for r in peer.regions if r.rkey}

    async def _post_all(
        self,
        conn: _Connection,
        pieces: list[tuple[int, int, int, int, int]],
        opcode: int,
        peer: PeerInfo,
        verb: str,
    ) -> None:
        """Post in chained batches, never more in flight than the queue depth; wait for all."""
        deadline = time.monotonic() + self.config.timeout
        batch = max(1, min(self.config.post_batch, conn.depth))
        every = max(1, self.config.signal_every)
        for first in range(0, len(pieces), batch):
            chunk = pieces[first : first + batch]
            await self._drain(conn, conn.depth - len(chunk), deadline, peer, verb)
            if conn.broken is not None:
                raise TransferFailed(
                    f"rdma: {verb} to instance {peer.instance_id} ({peer.host}): {conn.broken}"
                )
            self._post_chunk(conn, chunk, opcode, every, peer, verb)
            await asyncio.sleep(0)  # a fast NIC never leaves the poll empty: let others run
        await self._drain(conn, 0, deadline, peer, verb)

    def _post_chunk(
        self,
        conn: _Connection,
        chunk: list[tuple[int, int, int, int, int]],
        opcode: int,
        every: int,
        peer: PeerInfo,
        verb: str,
    ) -> None:
        v = self.v
        wrs: list[Any] = []  # kept alive until post_send returns: the chain points into them
        since_signal = 0
        for i, (laddr, lkey, length, raddr, rkey) in enumerate(chunk):
            since_signal += 1
            signaled = since_signal == every or i == len(chunk) - 1
            wr_id = conn.next_wr_id
            conn.next_wr_id += 1
            sge = v.SGE(laddr, length, lkey)
            flags = v.e.IBV_SEND_SIGNALED if signaled else 0
            wr = v.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
            wr.set_wr_rdma(rkey, raddr)
            if wrs:
                wrs[-1].next_wr = wr
            wrs.append(wr)
            if signaled:
                conn.groups.append(_Group(wr_id, since_signal))
                since_signal = 0
        try:
            conn.qp.post_send(wrs[0])
        except Exception as exc:
            conn.broken = f"post_send failed: {exc}"
            raise TransferFailed(
                f"rdma: {verb} to instance {peer.instance_id} ({peer.host}): {conn.broken}"
            ) from exc
        conn.outstanding += len(chunk)
        self.calls += len(chunk)

    async def _drain(
        self, conn: _Connection, limit: int, deadline: float, peer: PeerInfo, verb: str
    ) -> None:
        """Poll completions until at most `limit` work requests are in flight."""
        spins = 0
        while conn.outstanding > limit:
            if conn.broken is not None:  # disconnect() while we waited
                raise TransferFailed(
                    f"rdma: {verb} to instance {peer.instance_id} ({peer.host}): {conn.broken}"
                )
            polled, wcs = conn.cq.poll(conn.depth)
            if polled:
                spins = 0
                for wc in wcs[:polled]:
                    self._complete(conn, wc, peer, verb)
                continue
            if time.monotonic() > deadline:
                conn.broken = "timed out"
                raise TransferFailed(
                    f"rdma: {verb} to instance {peer.instance_id} ({peer.host}) timed out after "
                    f"{self.config.timeout:g} s with {conn.outstanding} work requests in flight"
                )
            spins += 1
            # Yield at once a few times (completions are microseconds away), then back off.
            await asyncio.sleep(0 if spins < 32 else min(0.001, 1e-5 * spins))

    def _complete(self, conn: _Connection, wc: Any, peer: PeerInfo, verb: str) -> None:
        if wc.status != self.v.e.IBV_WC_SUCCESS:
            conn.broken = f"completion status {self._status(wc.status)} (wr {wc.wr_id})"
            raise TransferFailed(
                f"rdma: {verb} to instance {peer.instance_id} ({peer.host}) failed: {conn.broken}"
            )
        # RC completes in order: this signaled request retires every group up to it.
        while conn.groups:
            group = conn.groups.popleft()
            conn.outstanding -= group.count
            if group.wr_id == wc.wr_id:
                return
        raise TransferFailed(f"rdma: unexpected completion wr {wc.wr_id} from {peer.instance_id}")

    def _status(self, status: int) -> str:
        try:
            text = f"{self.v.wc_status_str(status).strip()} ({int(status)})"
        except Exception:
            text = str(int(status))
        hint = {
            int(self.v.e.IBV_WC_RETRY_EXC_ERR): "peer unreachable or gone",
            int(self.v.e.IBV_WC_REM_ACCESS_ERR): "peer refused the access: stale key or range",
            int(self.v.e.IBV_WC_WR_FLUSH_ERR): "flushed after an earlier error",
        }.get(int(status))
        return f"{text}: {hint}" if hint else text

    # ----------------------------------------------------------------- teardown

    async def disconnect(self, peer_id: int) -> None:
        """Forget a peer: its queue pairs go; an operation waiting on them fails."""
        conns = [self._conns.pop(peer_id, None), *self._passive.pop(peer_id, [])]
        for conn in conns:
            if conn is None:
                continue
            if conn.lock.locked():
                conn.broken = "disconnected"  # the running operation fails and destroys it
            else:
                conn.destroy()

    async def close(self) -> None:
        if self._closed:
            return
        for peer_id in {*self._conns, *self._passive}:
            await self.disconnect(peer_id)
        self._closed = True
        for mr in self._mrs.values():
            mr.close()
        self._mrs.clear()
        self._local.clear()
        for obj in (self.pd, self.ctx):
            obj.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferFailed("rdma: transport is closed")


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """merge_segments after sorting by source: blocks come from the allocator in any order
    (a fresh pool hands them out in descending address order), and a one-sided operation
    completes as a whole, so the order of its pieces does not matter."""
    return merge_segments(sorted(segments, key=lambda s: (s.src_type, s.dst_type, s.src_offset)))


def _tier(mem_type: int) -> str:
    try:
        return MemType(mem_type).name.lower()
    except ValueError:
        return f"type {mem_type}"
