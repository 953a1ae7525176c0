"""The TCP data plane on its own (as a benchmark uses it) and the same-process memcpy path:
bytes intact, parallel streams, refusals that leave the arena untouched, authentication."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Iterator

import pytest

from mempool import InvalidRequest, KVBlockSpec, MemPool
from mempool.transfer.auth import AuthenticationFailed
from mempool.transfer.base import PeerInfo, Segment, TransferFailed, merge_segments
from mempool.transfer.local import LocalTransport
from mempool.transfer.tcp import TcpTransport, partition

SPEC = KVBlockSpec(layers=4, kv_heads=8, head_dim=64, dtype="float16", page_size=16)  # 64 KiB
HOST = 2
Pools = tuple[MemPool, MemPool]


@pytest.fixture
def pools() -> Iterator[Pools]:
    a, b = MemPool(1, SPEC, host_blocks=64), MemPool(2, SPEC, host_blocks=64)
    a.region("host")[:] = os.urandom(64 * a.block_size)
    b.region("host")[:] = os.urandom(64 * b.block_size)
    yield a, b
    a.close()
    b.close()


def peer_of(transport_endpoint: dict, instance: int, name: str = "tcp") -> PeerInfo:
    return PeerInfo(instance, "127.0.0.1", 0, endpoints={name: transport_endpoint})


def blocks(pool: MemPool, ids: list[tuple[int, int]]) -> list[Segment]:
    bs = pool.block_size
    return [Segment(HOST, i * bs, HOST, j * bs, bs) for i, j in ids]


def test_partition_slices_large_segments_evenly() -> None:
    segs = [Segment(HOST, 0, HOST, 1000, 10 << 20), Segment(HOST, 20 << 20, HOST, 0, 2 << 20)]
    parts = partition(segs, 4, 1 << 20)
    assert len(parts) == 4
    assert [sum(s.length for s in p) for p in parts] == [3 << 20] * 4
    # rejoined, the slices are exactly the original segments
    assert merge_segments([s for p in parts for s in p]) == segs
    assert len(partition(segs[:1], 4, 64 << 20)) == 1  # small transfers use one stream


def test_write_and_read_move_exact_bytes_over_parallel_streams(pools: Pools) -> None:
    a, b = pools

    async def main() -> None:
        ta, tb = TcpTransport(a, streams=3), TcpTransport(b, streams=3, min_stream_bytes=1)
        await ta.start()
        peer = peer_of(await tb.start(), 2)
        src = bytes(a.region("host"))
        # blocks 0..9 -> 20..29 (one merged run) and 40 -> 5
        segs = merge_segments(blocks(a, [(i, 20 + i) for i in range(10)] + [(40, 5)]))
        assert len(segs) == 2
        moved = await ta.write(peer, segs)
        bs = a.block_size
        assert moved == 11 * bs
        assert bytes(b.region("host")[20 * bs : 30 * bs]) == src[: 10 * bs]
        assert bytes(b.region("host")[5 * bs : 6 * bs]) == src[40 * bs : 41 * bs]
        assert ta.calls == 2 and tb.bytes_received == 11 * bs
        assert len(tb._served) == 3  # three authenticated streams carried it
        # read the other way: b's blocks 50..59 into a's blocks 0..9
        expect = bytes(b.region("host")[50 * bs : 60 * bs])
        read = [Segment(HOST, 50 * bs, HOST, 0, 10 * bs)]
        assert await ta.read(peer, read) == 10 * bs
        assert bytes(a.region("host")[: 10 * bs]) == expect
        await ta.close()
        await tb.close()

    asyncio.run(main())


def test_refused_write_leaves_the_arena_and_the_stream_intact(pools: Pools) -> None:
    a, b = pools
    bs = a.block_size

    def only_block_7(peer: int, op: str, mem_type: int, offset: int, length: int) -> str | None:
        ok = op == "write" and offset >= 7 * bs and offset + length <= 8 * bs
        return None if ok else f"instance {peer} may not {op} there"

    async def main() -> None:
        ta, tb = TcpTransport(a, streams=2), TcpTransport(b, access=only_block_7)
        await ta.start()
        peer = peer_of(await tb.start(), 2)
        before = bytes(b.region("host"))
        with pytest.raises(
            TransferFailed, match=r"instance 2 at 127\.0\.0\.1.*refused.*may not write"
        ):
            await ta.write(peer, blocks(a, [(0, 3), (1, 4)]))
        with pytest.raises(TransferFailed, match="may not read"):
            await ta.read(peer, blocks(a, [(7, 0)]))
        with pytest.raises(TransferFailed, match="outside tier"):
            await ta.write(peer, [Segment(HOST, 0, HOST, 63 * bs, 2 * bs)])
        assert bytes(b.region("host")) == before
        # the same streams still serve an allowed write
        assert await ta.write(peer, blocks(a, [(9, 7)])) == bs
        assert bytes(b.region("host")[7 * bs : 8 * bs]) == bytes(a.region("host")[9 * bs : 10 * bs])
        # local bounds are checked before anything is sent
        with pytest.raises(InvalidRequest, match="outside tier"):
            await ta.write(peer, [Segment(HOST, 64 * bs, HOST, 0, bs)])
        await ta.close()
        await tb.close()

    asyncio.run(main())


def test_wrong_secret_moves_no_byte(pools: Pools) -> None:
    a, b = pools

    async def main() -> None:
        tb = TcpTransport(b, secret="right")
        endpoint = await tb.start()
        before = bytes(b.region("host"))
        for secret in ("wrong", None):
            ta = TcpTransport(a, secret=secret)
            await ta.start()
            with pytest.raises(AuthenticationFailed, match="instance 2"):
                await ta.write(peer_of(endpoint, 2), blocks(a, [(0, 0)]))
            with pytest.raises(AuthenticationFailed):
                await ta.read(peer_of(endpoint, 2), blocks(a, [(0, 0)]))
            await ta.close()
        # a raw client that skips the handshake and sends a write header is dropped
        loop = asyncio.get_running_loop()
        raw = socket.socket()
        raw.setblocking(False)
        await loop.sock_connect(raw, ("127.0.0.1", endpoint["port"]))
        header = struct.pack("<BIQI", 1, 1, 16, 1) + struct.pack("<QQQ", HOST, 0, 16)
        await loop.sock_sendall(raw, header + b"x" * 16)
        assert await asyncio.wait_for(loop.sock_recv(raw, 100), 5) == b""  # closed on us
        raw.close()
        assert bytes(b.region("host")) == before
        assert not tb._served
        await tb.close()

    asyncio.run(main())


def test_a_gone_peer_fails_fast_and_names_it(pools: Pools) -> None:
    a, b = pools

    async def main() -> None:
        ta, tb = TcpTransport(a, timeout_s=2), TcpTransport(b)
        await ta.start()
        peer = peer_of(await tb.start(), 2)
        await ta.write(peer, blocks(a, [(0, 0)]))
        await tb.close()
        with pytest.raises(TransferFailed, match=r"instance 2 at 127\.0\.0\.1"):
            await asyncio.wait_for(ta.write(peer, blocks(a, [(0, 0)])), 3)
        with pytest.raises(TransferFailed, match="publishes no tcp"):
            await ta.write(PeerInfo(2, "127.0.0.1", 0), blocks(a, [(0, 0)]))
        await ta.close()

    asyncio.run(main())


def test_local_transport_copies_between_pools_of_one_process(pools: Pools) -> None:
    a, b = pools
    bs = a.block_size

    async def main() -> None:
        la, lb = LocalTransport(a), LocalTransport(b)
        await la.start()
        peer = peer_of(await lb.start(), 2, "local")
        await la.write(peer, blocks(a, [(3, 4)]))
        assert bytes(b.region("host")[4 * bs : 5 * bs]) == bytes(a.region("host")[3 * bs : 4 * bs])
        await la.read(peer, blocks(a, [(10, 11)]))
        assert bytes(a.region("host")[11 * bs : 12 * bs]) == bytes(
            b.region("host")[10 * bs : 11 * bs]
        )
        lb.access = lambda *args: "no"
        before = bytes(b.region("host"))
        with pytest.raises(TransferFailed, match="refused: no"):
            await la.write(peer, blocks(a, [(0, 0), (1, 1)]))
        assert bytes(b.region("host")) == before
        with pytest.raises(TransferFailed, match="not a pool of this process"):
            await la.write(
                PeerInfo(9, "x", 0, endpoints={"local": {"pid": -1}}), blocks(a, [(0, 0)])
            )
        with pytest.raises(InvalidRequest, match="already registered"):
            await LocalTransport(b).start()
        await la.close()
        await lb.close()

    asyncio.run(main())
