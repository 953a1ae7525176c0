"""RdmaTransport against the verbs double (no RDMA device exists here) and real pyverbs' import.

The double copies bytes between two real MemPools' arenas, enforces queue depth, keys,
bounds and the connection handshake, so these tests fail if the transport posts too many
requests, forgets to signal, wires the queue pairs wrongly or mishandles a completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from mempool import KVBlockSpec, Layout, MemPool, MemType
from mempool.transfer.base import PeerInfo, Segment, TransferFailed
from mempool.transfer.rdma import (
    RdmaConfig,
    RdmaTransport,
    RdmaUnavailable,
    load_pyverbs,
    rdma_devices,
)
from tests.mempool.transfer.verbs_double import E, Fabric, NoDeviceVerbs, VerbsDouble

SPEC = KVBlockSpec(layers=4, kv_heads=2, head_dim=8, dtype="float16", page_size=16)
HOST = int(MemType.HOST)


@dataclass
class Side:
    pool: MemPool
    verbs: VerbsDouble
    transport: RdmaTransport
    info: PeerInfo


@dataclass
class Pair:
    fabric: Fabric
    a: Side
    b: Side


def make_pair(
    layout: Layout = Layout.DISCRETE, config: RdmaConfig | None = None, blocks: int = 512
) -> Pair:
    """Two pools on two double hosts; a's exchange hands offers straight to b's accept."""
    fabric = Fabric()
    sides: list[Side] = []
    for instance in (1, 2):
        pool = MemPool(instance, SPEC, host_blocks=blocks, layout=layout)
        verbs = fabric.host(device=f"mlx5_{instance - 1}")
        transport = RdmaTransport(pool, config, verbs=verbs)
        endpoint = asyncio.run(transport.start())
        info = PeerInfo(instance, "127.0.0.1", 0, transport.regions, {"rdma": endpoint})
        sides.append(Side(pool, verbs, transport, info))
    a, b = sides

    async def to_b(peer: PeerInfo, offer: dict[str, Any]) -> dict[str, Any]:
        assert peer.instance_id == 2
        return await b.transport.accept(offer)

    async def to_a(peer: PeerInfo, offer: dict[str, Any]) -> dict[str, Any]:
        return await a.transport.accept(offer)

    a.transport.exchange = to_b
    b.transport.exchange = to_a
    return Pair(fabric, a, b)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = make_pair()
    yield p
    for side in (p.a, p.b):
        asyncio.run(side.transport.close())
        side.pool.close()


def fill(pool: MemPool, addrs: list[int], seed: int) -> None:
    rng = random.Random(seed)
    for addr in addrs:
        pool.write_block(addr, rng.randbytes(pool.block_size))


def digest(pool: MemPool, addrs: list[int]) -> str:
    h = hashlib.sha256()
    for addr in addrs:
        h.update(pool.read_block(addr))
    return h.hexdigest()


def segments(
    src: MemPool, src_addrs: list[int], dst: MemPool, dst_addrs: list[int]
) -> list[Segment]:
    out = []
    for s, d in zip(src_addrs, dst_addrs, strict=True):
        st, so = src.offset_of(s)
        dt, do = dst.offset_of(d)
        out.append(Segment(int(st), so, int(dt), do, src.block_size))
    return out


def scattered(pool: MemPool, n: int, seed: int) -> list[int]:
    """n blocks in a shuffled order: no two consecutive segments are contiguous."""
    addrs = pool.alloc_blocks(n)
    rng = random.Random(seed)
    while True:
        rng.shuffle(addrs)
        if all(abs(x - y) != 1 for x, y in itertools.pairwise(addrs)):
            return addrs


def test_write_pushes_bytes_intact(pair: Pair) -> None:
    src = pair.a.pool.alloc_blocks(64)
    dst = scattered(pair.b.pool, 64, seed=1)
    fill(pair.a.pool, src, seed=2)
    moved = asyncio.run(
        pair.a.transport.write(pair.b.info, segments(pair.a.pool, src, pair.b.pool, dst))
    )
    assert moved == 64 * pair.a.pool.block_size
    assert digest(pair.b.pool, dst) == digest(pair.a.pool, src)
    assert pair.fabric.counters.bytes_moved == moved


def test_read_pulls_bytes_intact(pair: Pair) -> None:
    remote = scattered(pair.b.pool, 40, seed=3)
    local = pair.a.pool.alloc_blocks(40)
    fill(pair.b.pool, remote, seed=4)
    segs = segments(pair.b.pool, remote, pair.a.pool, local)  # src = peer, dst = local
    moved = asyncio.run(pair.a.transport.read(pair.b.info, segs))
    assert moved == 40 * pair.a.pool.block_size
    assert digest(pair.a.pool, local) == digest(pair.b.pool, remote)


def test_both_directions_over_one_pair(pair: Pair) -> None:
    """b writes back over the queue pair a's connect created (b accepted it)."""
    a_blocks, b_blocks = pair.a.pool.alloc_blocks(8), pair.b.pool.alloc_blocks(8)
    fill(pair.a.pool, a_blocks, seed=5)
    asyncio.run(
        pair.a.transport.write(pair.b.info, segments(pair.a.pool, a_blocks, pair.b.pool, b_blocks))
    )
    fill(pair.b.pool, b_blocks, seed=6)
    asyncio.run(
        pair.b.transport.write(pair.a.info, segments(pair.b.pool, b_blocks, pair.a.pool, a_blocks))
    )
    assert digest(pair.a.pool, a_blocks) == digest(pair.b.pool, b_blocks)
    assert len(pair.fabric.qps) == 2  # one queue pair on each side, no second handshake


def test_work_requests_batched_signaled_and_bounded() -> None:
    config = RdmaConfig(qp_depth=24, post_batch=8, signal_every=3)
    p = make_pair(config=config)
    n = 100
    src = scattered(p.a.pool, n, seed=7)
    dst = scattered(p.b.pool, n, seed=8)
    fill(p.a.pool, src, seed=9)
    asyncio.run(p.a.transport.write(p.b.info, segments(p.a.pool, src, p.b.pool, dst)))
    c = p.fabric.counters
    assert p.a.transport.calls == c.work_requests == n  # nothing contiguous: one each
    assert c.post_send_calls == math.ceil(n / 8)  # chained, one post per batch
    # Within each batch of 8: positions 3 and 6 and the last one are signaled.
    full, tail = divmod(n, 8)
    assert c.signaled == full * 3 + (tail // 3 + (tail % 3 != 0))
    assert c.max_in_flight <= 24
    assert digest(p.b.pool, dst) == digest(p.a.pool, src)


def test_contiguous_segments_merge_into_one_request() -> None:
    page = 2 * SPEC.layers  # a discrete page: 2L adjacent blocks on both sides
    for merge, expected in ((True, 1), (False, page)):
        p = make_pair(config=RdmaConfig(merge=merge))
        src, dst = p.a.pool.alloc_blocks(page), p.b.pool.alloc_blocks(page)
        fill(p.a.pool, src, seed=10)
        asyncio.run(p.a.transport.write(p.b.info, segments(p.a.pool, src, p.b.pool, dst)))
        assert p.a.transport.calls == p.fabric.counters.work_requests == expected, merge
        assert digest(p.b.pool, dst) == digest(p.a.pool, src)


def test_large_segments_split_at_max_wr_bytes() -> None:
    p = make_pair(layout=Layout.AGGREGATED, config=RdmaConfig(max_wr_bytes=1000), blocks=8)
    src, dst = p.a.pool.alloc_blocks(4), p.b.pool.alloc_blocks(4)
    fill(p.a.pool, src, seed=11)
    asyncio.run(p.a.transport.write(p.b.info, segments(p.a.pool, src, p.b.pool, dst)))
    total = 4 * p.a.pool.block_size  # merged into one run, then cut into 1000-byte requests
    assert p.a.transport.calls == math.ceil(total / 1000)
    assert digest(p.b.pool, dst) == digest(p.a.pool, src)


@pytest.mark.parametrize(
    ("status", "words"),
    [(E.IBV_WC_REM_ACCESS_ERR, "remote access error"), (E.IBV_WC_LOC_PROT_ERR, "protection")],
)
def test_bad_completion_raises_and_reconnects(pair: Pair, status: int, words: str) -> None:
    src = scattered(pair.a.pool, 50, seed=12)
    dst = scattered(pair.b.pool, 50, seed=13)
    fill(pair.a.pool, src, seed=14)
    segs = segments(pair.a.pool, src, pair.b.pool, dst)
    pair.fabric.fail_after(20, status)
    with pytest.raises(TransferFailed, match=rf"instance 2 .*{words}"):
        asyncio.run(pair.a.transport.write(pair.b.info, segs))
    qps_before = set(pair.fabric.qps)
    asyncio.run(pair.a.transport.write(pair.b.info, segs))  # a fresh queue pair
    assert set(pair.fabric.qps) - qps_before, "the broken queue pair was reused"
    assert digest(pair.b.pool, dst) == digest(pair.a.pool, src)


def test_lost_peer_raises_transfer_failed(pair: Pair) -> None:
    src, dst = pair.a.pool.alloc_blocks(4), pair.b.pool.alloc_blocks(4)
    segs = segments(pair.a.pool, src, pair.b.pool, dst)
    asyncio.run(pair.a.transport.write(pair.b.info, segs))
    pair.fabric.unplug(pair.b.verbs)
    with pytest.raises(TransferFailed, match=r"instance 2 .*unreachable"):
        asyncio.run(
            pair.a.transport.read(pair.b.info, segments(pair.b.pool, dst, pair.a.pool, src))
        )


def test_garbled_handshake_never_delivers(pair: Pair) -> None:
    """The peer got a wrong psn: it drops every packet as out of sequence, retries run out."""

    async def wrong_psn(peer: PeerInfo, offer: dict[str, Any]) -> dict[str, Any]:
        return await pair.b.transport.accept({**offer, "psn": (offer["psn"] + 1) % (1 << 24)})

    pair.a.transport.exchange = wrong_psn
    src, dst = pair.a.pool.alloc_blocks(2), pair.b.pool.alloc_blocks(2)
    fill(pair.a.pool, src, seed=15)
    with pytest.raises(TransferFailed, match="retry exceeded"):
        asyncio.run(
            pair.a.transport.write(pair.b.info, segments(pair.a.pool, src, pair.b.pool, dst))
        )
    assert digest(pair.b.pool, dst) != digest(pair.a.pool, src)


def test_stalled_completions_time_out() -> None:
    p = make_pair(config=RdmaConfig(timeout=0.05))
    p.fabric.per_poll = 0  # the "NIC" never executes anything
    src, dst = p.a.pool.alloc_blocks(3), p.b.pool.alloc_blocks(3)
    with pytest.raises(TransferFailed, match=r"instance 2 .*timed out"):
        asyncio.run(p.a.transport.write(p.b.info, segments(p.a.pool, src, p.b.pool, dst)))


def test_disconnect_fails_the_operation_in_flight() -> None:
    p = make_pair(config=RdmaConfig(qp_depth=4, post_batch=4, signal_every=1))
    p.fabric.per_poll = 1
    src = scattered(p.a.pool, 64, seed=16)
    dst = scattered(p.b.pool, 64, seed=17)

    async def scenario() -> None:
        task = asyncio.create_task(
            p.a.transport.write(p.b.info, segments(p.a.pool, src, p.b.pool, dst))
        )
        while p.fabric.counters.work_requests < 8:
            await asyncio.sleep(0)
        await p.a.transport.disconnect(2)
        with pytest.raises(TransferFailed, match="disconnected"):
            await task

    asyncio.run(scenario())
    assert not [qp for (gid, _), qp in p.fabric.qps.items() if gid == p.a.verbs.host.gid]


def test_out_of_range_segment_is_refused_before_posting(pair: Pair) -> None:
    length = pair.b.transport.regions[0].length
    bad = [Segment(HOST, 0, HOST, length - 10, 64)]
    with pytest.raises(TransferFailed, match="runs past the host arena of instance 2"):
        asyncio.run(pair.a.transport.write(pair.b.info, bad))
    assert pair.fabric.counters.work_requests == 0


def test_connect_needs_a_control_channel(pair: Pair) -> None:
    pair.a.transport.exchange = None
    with pytest.raises(TransferFailed, match="no control channel"):
        asyncio.run(pair.a.transport.connect(pair.b.info))


def test_endpoint_publishes_what_a_peer_needs(pair: Pair) -> None:
    endpoint = pair.a.info.endpoints["rdma"]
    assert endpoint["device"] == "mlx5_0" and endpoint["lid"] == 1
    assert endpoint["gid"] == pair.a.verbs.host.gid
    (region,) = endpoint["regions"]
    assert region["mem_type"] == HOST and region["rkey"] != 0
    assert region["base"] == pair.a.pool.region_base(MemType.HOST)
    assert region["length"] == 512 * pair.a.pool.block_size
    assert pair.fabric.counters.registrations == 2  # one per tier per instance, at start


def test_no_device_is_a_clear_error_at_construction() -> None:
    pool = MemPool(1, SPEC, host_blocks=4)
    try:
        with pytest.raises(RdmaUnavailable, match="no RDMA device"):
            RdmaTransport(pool, verbs=NoDeviceVerbs())
        with pytest.raises(RdmaUnavailable, match=r"'mlx5_9' not found.*mlx5_0"):
            RdmaTransport(pool, RdmaConfig(device="mlx5_9"), verbs=Fabric().host())
        down = Fabric().host()
        down.host.port_state = E.IBV_PORT_DOWN
        with pytest.raises(RdmaUnavailable, match="not active"):
            RdmaTransport(pool, verbs=down)
    finally:
        pool.close()


def test_double_refuses_what_a_nic_refuses() -> None:
    """The double's own guard rails, so passing tests mean something."""
    p = make_pair()
    conn_offer = asyncio.run(p.a.transport.connect(p.b.info))
    assert conn_offer is None
    conn = p.a.transport._conns[2]
    v = p.a.verbs
    base, _, lkey = p.a.transport._local[HOST]
    wrs = [
        v.SendWR(
            wr_id=i + 1,
            opcode=E.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[v.SGE(base, 8, lkey)],
            send_flags=0,
        )
        for i in range(conn.depth + 1)
    ]
    for x, y in itertools.pairwise(wrs):
        x.next_wr = y
    with pytest.raises(v.Error, match="in flight"):
        conn.qp.post_send(wrs[0])  # one more than the queue holds


# ---------------------------------------------------------------- real pyverbs


def _real_pyverbs() -> Any:
    try:
        return load_pyverbs()
    except RdmaUnavailable as exc:
        if os.path.isdir("/usr/lib/python3/dist-packages/pyverbs"):
            raise AssertionError(f"pyverbs is installed but not importable: {exc}") from exc
        pytest.skip(f"Debian's python3-pyverbs is not installed here: {exc}")


def test_real_pyverbs_imports_and_lists_no_device() -> None:
    verbs = _real_pyverbs()
    assert verbs.MR.__module__ == "pyverbs.mr"
    assert rdma_devices(verbs) == []  # the kernel here has no InfiniBand support
    pool = MemPool(1, SPEC, host_blocks=4)
    try:
        with pytest.raises(RdmaUnavailable, match="no RDMA device"):
            RdmaTransport(pool)
    finally:
        pool.close()


def test_double_constants_are_the_verbs_abi() -> None:
    verbs = _real_pyverbs()
    for name, value in vars(E).items():
        assert int(getattr(verbs.e, name)) == value, name
