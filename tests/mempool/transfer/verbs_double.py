"""An in-memory stand-in for the part of pyverbs the RDMA transport uses.

No RDMA device exists on our machines, so the transport's logic (registration, queue-pair
state machine, chained and selectively signaled work requests, queue-depth accounting,
completion handling) runs against this double. It behaves as a NIC would where the
transport could get it wrong:

- a one-sided WRITE or READ really copies bytes (ctypes.memmove) between the registered
  arenas of two pools in this process, after checking lkey/rkey, bounds and access flags;
- work requests execute lazily, a few per `poll`, so the transport must poll;
- a queue pair's send queue holds at most `max_send_wr` requests, and a slot frees only
  when a later signaled completion is polled (as with real verbs); overflow fails post_send;
- a queue pair connects only to the queue pair, lid/gid and psn it was given; a mismatch
  or an unplugged peer ends in IBV_WC_RETRY_EXC_ERR, after which every request left on the
  queue pair is flushed (IBV_WC_WR_FLUSH_ERR), signaled or not;
- failures can be injected: a bad status on the n-th request from now, or a lost peer.

Numeric constants are the verbs ABI values (checked against real pyverbs in test_rdma).
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

E = SimpleNamespace(
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_QPT_RC=2,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_SEND_SIGNALED=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_LEN_ERR=1,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_INV_REQ_ERR=9,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_PORT_ACTIVE=4,
    IBV_PORT_DOWN=1,
    IBV_MTU_1024=3,
    IBV_MTU_4096=5,
)
STATUS_TEXT = {
    0: "success",
    1: "local length error",
    4: "local protection error",
    5: "Work Request flushed error",
    9: "remote invalid request error",
    10: "remote access error",
    12: "retry exceeded error",
}


class VerbsError(Exception):
    """What pyverbs raises (PyverbsError and its RDMA subclass)."""


@dataclass
class Counters:
    """What the transport did, for tests to count."""

    post_send_calls: int = 0
    work_requests: int = 0
    signaled: int = 0
    max_in_flight: int = 0
    polls: int = 0
    bytes_moved: int = 0
    registrations: int = 0


@dataclass
class Fabric:
    """The network between devices: finds queue pairs and memory regions, injects faults."""

    counters: Counters = field(default_factory=Counters)
    hosts: dict[str, Host] = field(default_factory=dict)
    qps: dict[tuple[str, int], FakeQP] = field(default_factory=dict)
    _qpn: itertools.count = field(default_factory=lambda: itertools.count(0x100))
    _key: itertools.count = field(default_factory=lambda: itertools.count(0x1000))
    faults: deque[tuple[int, int]] = field(default_factory=deque)  # (requests to skip, status)
    unplugged: set[str] = field(default_factory=set)
    executed: int = 0
    per_poll: int = 8  # work requests a poll executes: transfers take several polls

    def host(self, device: str = "mlx5_0", lid: int | None = None) -> VerbsDouble:
        """A machine with one device on this fabric, as a pyverbs-like module."""
        index = len(self.hosts) + 1
        gid = f"fe80:0000:0000:0000:0000:0000:0000:{index:04x}"
        host = Host(self, device, lid if lid is not None else index, gid)
        self.hosts[gid] = host
        return VerbsDouble(host)

    def fail_after(self, requests: int, status: int) -> None:
        """The request `requests` executions from now completes with `status`."""
        self.faults.append((self.executed + requests, status))

    def unplug(self, verbs: VerbsDouble) -> None:
        """That host's NIC is gone: requests to it exhaust their retries."""
        self.unplugged.add(verbs.host.gid)


@dataclass
class Host:
    fabric: Fabric
    device: str
    lid: int
    gid: str
    port_state: int = E.IBV_PORT_ACTIVE
    mtu: int = E.IBV_MTU_4096
    max_qp_wr: int = 16384
    mrs: dict[int, FakeMR] = field(default_factory=dict)  # rkey -> MR


class FakeDevice:
    def __init__(self, name: str) -> None:
        self.name = name.encode()


class FakeContext:
    def __init__(self, host: Host, name: str) -> None:
        if name != host.device:
            raise VerbsError(f"device {name} not found")
        self.host = host
        self.closed = False

    def query_port(self, port: int) -> SimpleNamespace:
        if port != 1:
            raise VerbsError(f"no port {port}")
        return SimpleNamespace(
            state=self.host.port_state, lid=self.host.lid, active_mtu=self.host.mtu
        )

    def query_device(self) -> SimpleNamespace:
        return SimpleNamespace(
            max_qp_wr=self.host.max_qp_wr, max_qp_rd_atom=16, max_qp_init_rd_atom=16
        )

    def query_gid(self, port: int, index: int) -> SimpleNamespace:
        return SimpleNamespace(gid=self.host.gid)

    def close(self) -> None:
        self.closed = True


class FakePD:
    def __init__(self, ctx: FakeContext) -> None:
        self.ctx = ctx
        self.host = ctx.host

    def close(self) -> None:
        pass


class FakeMR:
    def __init__(self, pd: FakePD, length: int, access: int, address: int | None = None) -> None:
        if not address:
            raise VerbsError("the double registers caller memory only (address=...)")
        self.host = pd.host
        self.addr = address
        self.length = length
        self.access = access
        self.lkey = self.rkey = next(self.host.fabric._key)
        self.host.mrs[self.rkey] = self
        self.host.fabric.counters.registrations += 1

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    def close(self) -> None:
        self.host.mrs.pop(self.rkey, None)


class FakeCQ:
    def __init__(self, ctx: FakeContext, cqe: int, cq_context: Any, channel: Any, vector: int):
        self.host = ctx.host
        self.cqe = cqe
        self.entries: deque[SimpleNamespace] = deque()
        self.qps: list[FakeQP] = []

    def poll(self, num_entries: int = 1) -> tuple[int, list[SimpleNamespace]]:
        self.host.fabric.counters.polls += 1
        for qp in self.qps:
            qp.progress(self.host.fabric.per_poll)
        out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        for wc in out:
            for qp in self.qps:
                qp.retire(wc)
        return len(out), out

    def close(self) -> None:
        pass


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr
        self.max_send_sge = max_send_sge
        self.max_recv_sge = max_recv_sge


class QPInitAttr:
    def __init__(self, qp_type=E.IBV_QPT_RC, scq=None, rcq=None, cap=None, sq_sig_all=1) -> None:
        self.qp_type = qp_type
        self.send_cq = scq
        self.recv_cq = rcq
        self.cap = cap or QPCap()
        self.sq_sig_all = sq_sig_all


class QPAttr:
    def __init__(self, qp_state=E.IBV_QPS_INIT, cur_qp_state=E.IBV_QPS_RESET, port_num=1):
        self.qp_state = qp_state
        self.port_num = port_num
        self.qp_access_flags = 0
        self.path_mtu = E.IBV_MTU_1024
        self.dest_qp_num = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_dest_rd_atomic = 0
        self.max_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ah_attr: AHAttr | None = None


class GID:
    def __init__(self, val: str | None = None) -> None:
        self.gid = val


class GlobalRoute:
    def __init__(self, dgid: GID | None = None, sgid_index: int = 0, **_: Any) -> None:
        self.dgid = dgid
        self.sgid_index = sgid_index


class AHAttr:
    def __init__(self, dlid=0, is_global=0, port_num=1, gr: GlobalRoute | None = None, **_: Any):
        self.dlid = dlid
        self.is_global = is_global
        self.port_num = port_num
        self.gr = gr


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey


class SendWR:
    def __init__(
        self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=2, next_wr=None
    ):
        if num_sge < 1 or not sg:
            raise VerbsError("A WR needs at least one SGE")
        self.wr_id = wr_id
        self.opcode = opcode
        self.sg = list(sg)[:num_sge]
        self.send_flags = send_flags
        self.next_wr = next_wr
        self.remote_addr = 0
        self.rkey = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = rkey
        self.remote_addr = addr


@dataclass
class _Posted:
    wr_id: int
    opcode: int
    sges: list[tuple[int, int, int]]
    remote_addr: int
    rkey: int
    signaled: bool


class FakeQP:
    def __init__(self, pd: FakePD, init: QPInitAttr, attr: QPAttr | None = None) -> None:
        if init.qp_type != E.IBV_QPT_RC:
            raise VerbsError("the double knows RC queue pairs only")
        self.host = pd.host
        self.fabric = self.host.fabric
        self.qp_num = next(self.fabric._qpn)
        self.cq: FakeCQ = init.send_cq
        self.cq.qps.append(self)
        self.depth = init.cap.max_send_wr
        self.sig_all = bool(init.sq_sig_all)
        self.qp_state = E.IBV_QPS_RESET
        self.attr = QPAttr()
        self.queue: deque[_Posted] = deque()  # posted, not yet executed
        self.unsignaled_done = 0  # executed unsignaled requests not yet covered by a signal
        self.covers: dict[int, int] = {}  # signaled wr_id -> unsignaled requests before it
        self.in_flight = 0  # send-queue slots in use
        self.fabric.qps[(self.host.gid, self.qp_num)] = self
        if attr is not None:
            self.to_init(attr)

    # state machine -------------------------------------------------------------

    def to_init(self, attr: QPAttr) -> None:
        if self.qp_state != E.IBV_QPS_RESET:
            raise VerbsError("INIT only from RESET")
        self.attr.qp_access_flags = attr.qp_access_flags
        self.attr.port_num = attr.port_num
        self.qp_state = E.IBV_QPS_INIT

    def to_rtr(self, attr: QPAttr) -> None:
        if self.qp_state == E.IBV_QPS_RESET:
            self.to_init(attr)
        if self.qp_state != E.IBV_QPS_INIT:
            raise VerbsError("RTR only from INIT")
        if attr.ah_attr is None or not attr.dest_qp_num:
            raise VerbsError("RTR needs ah_attr and dest_qp_num")
        for name in ("dest_qp_num", "rq_psn", "path_mtu", "max_dest_rd_atomic", "ah_attr"):
            setattr(self.attr, name, getattr(attr, name))
        self.qp_state = E.IBV_QPS_RTR

    def to_rts(self, attr: QPAttr) -> None:
        if self.qp_state != E.IBV_QPS_RTR:
            self.to_rtr(attr)
        for name in ("sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"):
            setattr(self.attr, name, getattr(attr, name))
        self.qp_state = E.IBV_QPS_RTS

    # data path -----------------------------------------------------------------

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        if self.qp_state != E.IBV_QPS_RTS:
            raise VerbsError(f"Failed to post send: queue pair in state {self.qp_state}")
        chain: list[SendWR] = []
        node: SendWR | None = wr
        while node is not None:
            chain.append(node)
            node = node.next_wr
        if self.in_flight + len(chain) > self.depth:
            raise VerbsError(
                f"Failed to post send: {self.in_flight} in flight + {len(chain)} > {self.depth}"
            )
        counters = self.fabric.counters
        counters.post_send_calls += 1
        for w in chain:
            signaled = self.sig_all or bool(w.send_flags & E.IBV_SEND_SIGNALED)
            sges = [(s.addr, s.length, s.lkey) for s in w.sg]
            self.queue.append(_Posted(w.wr_id, w.opcode, sges, w.remote_addr, w.rkey, signaled))
            counters.work_requests += 1
            counters.signaled += signaled
        self.in_flight += len(chain)
        counters.max_in_flight = max(counters.max_in_flight, self.in_flight)

    def progress(self, budget: int) -> None:
        """Execute up to `budget` posted requests, as the NIC would between polls."""
        while self.queue and budget > 0:
            budget -= 1
            req = self.queue.popleft()
            status = E.IBV_WC_WR_FLUSH_ERR if self.qp_state == E.IBV_QPS_ERR else self._execute(req)
            if status != E.IBV_WC_SUCCESS:
                self.qp_state = E.IBV_QPS_ERR
            if req.signaled or status != E.IBV_WC_SUCCESS:
                self.cq.entries.append(
                    SimpleNamespace(
                        wr_id=req.wr_id, status=status, qp_num=self.qp_num, vendor_err=0
                    )
                )
            if status == E.IBV_WC_SUCCESS:
                if req.signaled:
                    self.covers[req.wr_id] = self.unsignaled_done
                    self.unsignaled_done = 0
                else:
                    self.unsignaled_done += 1
            else:
                self.in_flight -= 1  # an error completion frees its own slot

    def retire(self, wc: SimpleNamespace) -> None:
        """A polled completion frees its slot and those of unsignaled requests before it."""
        if wc.qp_num != self.qp_num or wc.status != E.IBV_WC_SUCCESS:
            return
        self.in_flight -= 1 + self.covers.pop(wc.wr_id, 0)

    def _execute(self, req: _Posted) -> int:
        fabric = self.fabric
        fabric.executed += 1
        if fabric.faults and fabric.faults[0][0] <= fabric.executed:
            return fabric.faults.popleft()[1]
        ah = self.attr.ah_attr
        dgid = ah.gr.dgid if ah is not None and ah.gr is not None else None
        gid = dgid.gid if dgid is not None else None
        remote_qp = fabric.qps.get((gid, self.attr.dest_qp_num)) if gid else None
        if (
            ah is None
            or remote_qp is None
            or gid in fabric.unplugged
            or remote_qp.qp_state == E.IBV_QPS_RESET
        ):
            return E.IBV_WC_RETRY_EXC_ERR
        peer = remote_qp.host
        if ah.dlid != peer.lid and peer.lid:
            return E.IBV_WC_RETRY_EXC_ERR
        # The responder accepts only packets from the queue pair it was pointed at, in sequence.
        if (
            remote_qp.attr.dest_qp_num != self.qp_num
            or remote_qp.attr.rq_psn != self.attr.sq_psn
            or remote_qp.qp_state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS)
            or remote_qp.attr.path_mtu != self.attr.path_mtu
        ):
            return E.IBV_WC_RETRY_EXC_ERR
        (laddr, length, lkey), *rest = req.sges
        if rest:
            return E.IBV_WC_LOC_LEN_ERR
        local = self.host.mrs.get(lkey)
        if local is None or not local.covers(laddr, length):
            return E.IBV_WC_LOC_PROT_ERR
        remote = peer.mrs.get(req.rkey)
        if remote is None or not remote.covers(req.remote_addr, length):
            return E.IBV_WC_REM_ACCESS_ERR
        if req.opcode == E.IBV_WR_RDMA_WRITE:
            need = E.IBV_ACCESS_REMOTE_WRITE
            if not (remote.access & need and remote_qp.attr.qp_access_flags & need):
                return E.IBV_WC_REM_ACCESS_ERR
            ctypes.memmove(req.remote_addr, laddr, length)
        elif req.opcode == E.IBV_WR_RDMA_READ:
            need = E.IBV_ACCESS_REMOTE_READ
            if not (remote.access & need and remote_qp.attr.qp_access_flags & need):
                return E.IBV_WC_REM_ACCESS_ERR
            if self.attr.max_rd_atomic < 1 or remote_qp.attr.max_dest_rd_atomic < 1:
                return E.IBV_WC_REM_INV_REQ_ERR
            if not local.access & E.IBV_ACCESS_LOCAL_WRITE:
                return E.IBV_WC_LOC_PROT_ERR
            ctypes.memmove(laddr, req.remote_addr, length)
        else:
            return E.IBV_WC_REM_INV_REQ_ERR
        fabric.counters.bytes_moved += length
        return E.IBV_WC_SUCCESS

    def close(self) -> None:
        self.queue.clear()
        self.qp_state = E.IBV_QPS_RESET
        self.fabric.qps.pop((self.host.gid, self.qp_num), None)
        if self in self.cq.qps:
            self.cq.qps.remove(self)


class VerbsDouble:
    """One host's view of pyverbs: what `mempool.transfer.rdma.load_pyverbs` returns."""

    Error = VerbsError
    PD = FakePD
    MR = FakeMR
    CQ = FakeCQ
    QP = FakeQP
    QPInitAttr = QPInitAttr
    QPCap = QPCap
    QPAttr = QPAttr
    AHAttr = AHAttr
    GlobalRoute = GlobalRoute
    GID = GID
    SGE = SGE
    SendWR = SendWR
    e = E

    def __init__(self, host: Host) -> None:
        self.host = host

    def get_device_list(self) -> list[FakeDevice]:
        return [FakeDevice(self.host.device)]

    def Context(self, name: str) -> FakeContext:
        return FakeContext(self.host, name)

    @staticmethod
    def wc_status_str(status: int) -> str:
        return STATUS_TEXT.get(int(status), f"status {status}")


class NoDeviceVerbs(VerbsDouble):
    """A host whose libibverbs lists no device, the way ours fails: an error, not a list."""

    def __init__(self) -> None:
        super().__init__(Host(Fabric(), "none", 0, ""))

    def get_device_list(self) -> list[FakeDevice]:
        raise VerbsError("Failed to get devices list")
