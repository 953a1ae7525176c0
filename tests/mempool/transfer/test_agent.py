"""TransferAgent over real loopback sockets: MemServe's transfer / transfer_with_insert in
every mode and layout pairing, incremental sends, KVDirect pulls, the receiver hook and every
refusal. Bytes are checked against the reference reconstruction in kv.py; every test ends
with the allocators' free counts back at their baseline (nothing leaked)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from mempool import (
    InvalidAddress,
    InvalidRequest,
    KVBlockSpec,
    MemPool,
    OutOfBlocks,
)
from mempool.transfer.auth import AuthenticationFailed
from mempool.transfer.base import PeerInfo, Segment, TransferFailed
from mempool.transfer.local import LocalTransport
from mempool.transfer.membership import InProcessCluster, UnknownPeer
from mempool.transfer.receiver import Received, TransferFlags
from mempool.transfer.tcp import TcpTransport

from .agents import agents, run
from .kv import alloc, digest, free_counts
from .procpeer import eventually

SPEC = KVBlockSpec(layers=3, kv_heads=4, head_dim=8, dtype="float16", page_size=4)
ALL = (0, 4)


def pool(
    instance: int, layout: str = "aggregated", page: int = 4, blocks: int = 256, **kw: Any
) -> MemPool:
    spec = KVBlockSpec(3, kw.pop("kv_heads", 4), 8, "float16", page)
    return MemPool(instance, spec, host_blocks=blocks, layout=layout, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def src_blocks(p: MemPool, num_tokens: int) -> list[int]:
    pages = -(-num_tokens // p.spec.page_size)
    return alloc(p, pages * p.blocks_per_page)


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize(
    ("layout", "mode", "calls_per_page"),
    [
        ("discrete", "by-request", 2 * SPEC.layers),  # one call per block
        ("aggregated", "by-request-agg", 1),  # one call per page
        ("aggregated", "by-layer", SPEC.layers),  # one call per layer per page
    ],
)
def test_modes_move_intact_bytes_and_insert(
    transport: str, layout: str, mode: str, calls_per_page: int
) -> None:
    a, b = pool(1, layout), pool(2, layout)
    base_a, base_b = free_counts(a), free_counts(b)
    tokens = prompt(22)  # 5 whole pages and a partial one

    async def main() -> None:
        async with agents(a, b, transport=transport) as (ta, tb):
            src = src_blocks(a, len(tokens))
            flags = TransferFlags.NO_MERGE
            if mode == "by-layer":
                stream = await ta.open_stream(2, src, tokens=tokens, flags=flags, private="r1")
                for layer in range(SPEC.layers):
                    await stream.send_layers(layer, layer + 1)
                result = await stream.finish()
            else:
                result = await ta.transfer_with_insert(2, tokens, src, flags=flags, private="r1")
            assert result.pages_sent == 6 and result.pages_skipped == 0
            assert result.calls == 6 * calls_per_page
            assert result.bytes == 6 * a.spec.page_bytes  # whole blocks, partial page included
            assert digest(b, result.dst_addrs, range(22), ALL) == digest(a, src, range(22), ALL)
            hit = b.match(tokens)
            assert hit.num_tokens == 20 and hit.addrs == result.dst_addrs[: 5 * b.blocks_per_page]
            arrived = await tb.wait_received(lambda r: r.private == "r1", timeout=2)
            assert arrived.inserted and arrived.addrs == result.dst_addrs
            b.free_mem(arrived.addrs[5 * b.blocks_per_page :])  # the engine's partial page
            a.free_mem(src)
        b.flush()

    run(main())
    assert free_counts(a) == base_a and free_counts(b) == base_b


def test_merging_turns_contiguous_blocks_into_one_call() -> None:
    a, b = pool(1, "discrete"), pool(2, "aggregated")

    async def main() -> None:
        async with agents(a, b) as (ta, _):
            src = src_blocks(a, 32)  # ascending: page after page, layer after layer
            merged = await ta.transfer(2, src)
            unmerged = await ta.transfer(2, src, flags=TransferFlags.NO_MERGE)
            assert merged.calls == 1  # 8 pages x 6 discrete blocks, all contiguous both sides
            assert unmerged.calls == 8 * 2 * SPEC.layers
            for r in (merged, unmerged):
                assert digest(b, r.dst_addrs, range(32), ALL) == digest(a, src, range(32), ALL)
                b.free_mem(r.dst_addrs)
            a.free_mem(src)

    run(main())


def test_incremental_transfer_sends_only_missing_pages() -> None:
    a, b = pool(1), pool(2)
    first, second = prompt(12), prompt(12) + prompt(14, seed=5)  # 3 pages, then 6.5 pages

    async def main() -> None:
        async with agents(a, b) as (ta, tb):
            src1 = src_blocks(a, 12)
            r1 = await ta.transfer_with_insert(2, first, src1)
            assert (r1.pages_sent, r1.pages_skipped) == (3, 0)
            src2 = src1 + src_blocks(a, 14)
            wire = ta.transport
            assert isinstance(wire, TcpTransport | LocalTransport)
            sent_before = wire.bytes_sent
            r2 = await ta.transfer_with_insert(2, second, src2)
            assert (r2.pages_sent, r2.pages_skipped) == (4, 3)
            assert r2.dst_addrs[:3] == r1.dst_addrs  # the cached pages were reused, not resent
            assert wire.bytes_sent - sent_before == 4 * a.spec.page_bytes
            assert digest(b, r2.dst_addrs, range(26), ALL) == digest(a, src2, range(26), ALL)
            assert b.match(second).num_tokens == 24
            # everything cached: nothing to send, only the acknowledgement
            r3 = await ta.transfer_with_insert(2, second[:24], src2[:6])
            assert (r3.pages_sent, r3.pages_skipped, r3.bytes, r3.calls) == (0, 6, 0, 0)
            # the receiver's engine is told which pages it had before each arrival
            arrivals = [await tb.wait_received(timeout=1) for _ in range(3)]
            assert [r.cached_pages for r in arrivals] == [0, 3, 6]
            b.free_mem(r2.dst_addrs[6:])
            a.free_mem(src2)

    run(main())
    b.flush()
    assert free_counts(b) == {"host": 256}


@pytest.mark.parametrize(
    ("src_layout", "src_page", "dst_layout", "dst_page"),
    [
        ("discrete", 4, "aggregated", 4),
        ("aggregated", 4, "discrete", 8),
        ("discrete", 8, "aggregated", 4),
        ("aggregated", 8, "discrete", 2),
    ],
)
def test_asymmetric_layouts_and_page_sizes(
    src_layout: str, src_page: int, dst_layout: str, dst_page: int
) -> None:
    a, b = pool(1, src_layout, src_page), pool(2, dst_layout, dst_page)
    tokens = prompt(30)

    async def main() -> None:
        async with agents(a, b) as (ta, tb):
            src = src_blocks(a, 30)
            result = await ta.transfer_with_insert(2, tokens, src)
            assert digest(b, result.dst_addrs, range(30), ALL) == digest(a, src, range(30), ALL)
            assert b.match(tokens).num_tokens == 30 // dst_page * dst_page
            # the same prompt again: the receiver has it, only the tail page(s) move
            again = await ta.transfer_with_insert(2, tokens, src)
            assert again.pages_skipped == 30 // dst_page
            for _ in range(2):  # the engine frees each request's partial page, if any
                tail = (await tb.wait_received(timeout=1)).addrs[
                    30 // dst_page * b.blocks_per_page :
                ]
                if tail:
                    b.free_mem(tail)

    run(main())
    b.flush()
    assert free_counts(b) == {"host": 256}


def test_tensor_parallel_shares() -> None:
    """Two TP ranks (heads 0-1 and 2-3) fill one receiver's blocks; a TP rank receives its
    half of a full sender's heads."""
    r0, r1 = pool(1, kv_heads=2), pool(2, kv_heads=2)
    full = pool(3, "discrete")
    half = pool(4, kv_heads=2)
    opts = [
        {"head_start": 0, "total_heads": 4},
        {"head_start": 2, "total_heads": 4},
        {},
        {"head_start": 2, "total_heads": 4},
    ]

    async def main() -> None:
        async with agents(r0, r1, full, half, options=opts) as (t0, t1, tf, _):
            s0, s1 = src_blocks(r0, 16), src_blocks(r1, 16)
            dst = sorted(full.alloc_blocks(4 * full.blocks_per_page))  # the engine's blocks
            with pytest.raises(InvalidRequest, match="only"):
                await t0.transfer(3, s0)  # allocating needs every head from one sender
            await asyncio.gather(t0.transfer(3, s0, dst), t1.transfer(3, s1, dst))
            assert digest(full, dst, range(16), (0, 2)) == digest(r0, s0, range(16), (0, 2))
            assert digest(full, dst, range(16), (2, 4)) == digest(
                r1, s1, range(16), (2, 4), head_start=2
            )
            got = await tf.transfer(4, dst)  # full sender -> rank holding heads 2-3
            assert digest(half, got.dst_addrs, range(16), (2, 4), head_start=2) == digest(
                full, dst, range(16), (2, 4)
            )
            half.free_mem(got.dst_addrs)
            full.free_mem(dst)

    run(main())


def test_layer_by_layer_with_destination_addresses() -> None:
    """MemServe figure 5 by-layer: the first call allocates, later ones name dst_addrs."""
    a, b = pool(1, "discrete"), pool(2, "discrete")
    seen: list[Received] = []

    async def main() -> None:
        async with agents(a, b, options=[{}, {"on_received": seen.append}]) as (ta, _):
            src = src_blocks(a, 16)
            first = await ta.transfer(2, src, layers=range(0, 1), private={"room": 7})
            for layer in range(1, SPEC.layers):
                r = await ta.transfer(2, src, first.dst_addrs, layers=range(layer, layer + 1))
                assert r.calls == 4  # one per page (K and V of a layer are adjacent blocks)
            assert digest(b, first.dst_addrs, range(16), ALL) == digest(a, src, range(16), ALL)
            assert [r.private for r in seen] == [{"room": 7}] + [None] * (SPEC.layers - 1)
            assert all(r.addrs == first.dst_addrs and not r.inserted for r in seen)
            b.free_mem(first.dst_addrs)
            a.free_mem(src)

    run(main())


def test_decode_side_waits_for_its_request() -> None:
    a, b = pool(1), pool(2)

    async def main() -> None:
        async with agents(a, b) as (ta, tb):
            src = src_blocks(a, 8)
            waiter = asyncio.create_task(
                tb.wait_received(lambda r: r.private["bootstrap_room"] == 42, timeout=3)
            )
            other = await ta.transfer(2, src, private={"bootstrap_room": 41})
            mine = await ta.transfer(2, src, private={"bootstrap_room": 42})
            got = await waiter
            assert got.addrs == mine.dst_addrs and got.peer_id == 1
            late = await tb.wait_received(lambda r: r.private["bootstrap_room"] == 41, timeout=1)
            assert late.addrs == other.dst_addrs  # arrived before anyone waited: kept
            with pytest.raises(TimeoutError):
                await tb.wait_received(timeout=0.1)
            b.free_mem(mine.dst_addrs + other.dst_addrs)
            a.free_mem(src)

    run(main())


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_pull_reads_the_missing_part_of_a_longer_prefix(transport: str) -> None:
    holder, puller = pool(1, "discrete"), pool(2, "aggregated", page=8)
    tokens = prompt(40)
    base = free_counts(puller)

    async def main() -> None:
        async with agents(holder, puller, transport=transport) as (th, tp):
            cached = src_blocks(holder, 40)
            holder.insert(tokens, cached)
            mine = src_blocks(puller, 16)  # the puller already has the first 16 tokens
            puller.insert(tokens[:16], mine)
            result = await tp.pull(1, tokens + [7, 7, 7])
            assert (result.num_tokens, result.pages_pulled, result.pages_skipped) == (40, 3, 2)
            assert result.bytes == 24 * puller.spec.bytes_per_token
            assert puller.match(tokens).num_tokens == 40
            pulled = range(16, 40)  # the first 16 tokens stayed the puller's own
            assert digest(puller, result.addrs, pulled, ALL) == digest(holder, cached, pulled, ALL)
            assert result.addrs[:2] == mine
            assert holder.stats()["protected_pages"] == 0  # the holder unlocked
            again = await tp.pull(1, tokens, TransferFlags.LOCK)
            assert again.pages_pulled == 0 and again.lock is not None
            assert puller.stats()["protected_pages"] == 5
            puller.release(again.lock)
            nothing = await tp.pull(1, prompt(9, seed=3))
            assert (nothing.num_tokens, nothing.pages_pulled) == (0, 0)
            assert th.session_count() == 1 and not th.grants._granted

    run(main())
    puller.flush()
    assert free_counts(puller) == base


def test_pull_that_fails_mid_read_frees_what_it_allocated() -> None:
    holder, puller = pool(1), pool(2)
    tokens = prompt(16)
    base = free_counts(puller)

    async def main() -> None:
        # (a connection slow to open on a loaded machine must not fail it before the read)
        async with agents(holder, puller, timeout_s=15.0) as (_, tp):
            holder.insert(tokens, src_blocks(holder, 16))

            async def broken(peer: PeerInfo, segments: Sequence[Segment]) -> int:
                raise TransferFailed("instance 1: the wire broke")

            tp.transport.read = broken  # type: ignore[method-assign]
            with pytest.raises(TransferFailed, match="wire broke"):
                await tp.pull(1, tokens)
            assert free_counts(puller) == base and puller.match(tokens).num_tokens == 0
            await asyncio.sleep(0.05)
            assert holder.stats()["protected_pages"] == 0

    run(main())


def test_bad_input_is_refused_clearly_and_leaks_nothing() -> None:
    a, b = pool(1), pool(2, blocks=8)
    base_a, base_b = free_counts(a), free_counts(b)

    async def main() -> None:
        async with agents(a, b) as (ta, tb):
            src = src_blocks(a, 16)
            with pytest.raises(UnknownPeer, match="instance 9 is not a live member"):
                await ta.transfer(9, src)
            with pytest.raises(InvalidRequest, match="this instance"):
                await ta.transfer(1, src)
            with pytest.raises(InvalidAddress, match="not an allocated block"):
                await ta.transfer(2, [src[0] + 100])
            with pytest.raises(InvalidRequest, match="13 tokens fill 4 pages"):
                await ta.transfer_with_insert(2, prompt(13), src[:3])
            with pytest.raises(InvalidRequest, match="4 tokens fill 1 pages"):
                await ta.transfer(2, src, num_tokens=4)
            with pytest.raises(InvalidRequest, match="must be a list"):
                await ta.transfer(2, 5)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="tokens must not be empty"):
                await ta.transfer_with_insert(2, [], src)
            with pytest.raises(InvalidAddress, match="belongs to instance 1, not to the receiver"):
                await ta.transfer(2, src, dst_addrs=src)
            dst = b.alloc_blocks(4)
            with pytest.raises(InvalidRequest, match="needs 4 destination addresses"):
                await ta.transfer(2, src, dst_addrs=dst[:2])
            b.free_mem(dst)  # stale addresses: the receiver no longer holds them
            with pytest.raises(InvalidAddress, match=r"refused prepare.*not an allocated block"):
                await ta.transfer(2, src, dst_addrs=dst)
            with pytest.raises(InvalidRequest, match="refused prepare: dst_addrs names a block"):
                held = b.alloc_blocks(4)
                await ta.transfer(2, src, dst_addrs=[held[0]] * 4)
            b.free_mem(held)
            cached = b.alloc_blocks(1)
            b.insert(prompt(4), cached)
            with pytest.raises(InvalidAddress, match="holds cached KV"):
                await ta.transfer(2, src[:1], dst_addrs=cached)
            b.flush()
            busy = b.alloc_blocks(6)  # the receiver's engine holds 6 of its 8 blocks
            with pytest.raises(
                OutOfBlocks, match=r"instance 2 refused prepare.*4 blocks requested"
            ):
                await ta.transfer_with_insert(2, prompt(16), src)
            b.free_mem(busy)
            assert tb.session_count() == 1 and not tb.grants._granted
            a.free_mem(src)

    run(main())
    assert free_counts(a) == base_a and free_counts(b) == base_b
    assert b.stats()["protected_pages"] == 0


def test_wrong_secret_cannot_read_or_write_a_byte() -> None:
    a, b, c = pool(1), pool(2), pool(3)
    cluster = InProcessCluster(ttl_s=5, heartbeat_s=1)
    tokens = prompt(16)

    async def main() -> None:
        async with (
            agents(b, membership=cluster, secret="s3cret") as (tb,),
            agents(a, c, membership=cluster, secret="guess") as (ta, tc),
        ):
            holder_blocks = src_blocks(b, 16)
            b.insert(tokens, holder_blocks)
            before, counts = bytes(b.region("host")), free_counts(b)
            src = src_blocks(a, 16)
            with pytest.raises(AuthenticationFailed, match="instance 2"):
                await ta.transfer_with_insert(2, tokens, src)
            with pytest.raises(AuthenticationFailed, match="instance 2"):
                await tc.pull(2, tokens)
            assert bytes(b.region("host")) == before and free_counts(b) == counts
            assert tb.session_count() == 0 and c.match(tokens).num_tokens == 0
            assert free_counts(c) == {"host": 256}
            # the data port refuses too, even with the right addresses in hand
            from mempool.transfer.base import Segment

            await ta.transport.start()
            with pytest.raises(AuthenticationFailed):
                await ta.transport.write(
                    tb.info,  # type: ignore[arg-type]
                    [Segment(2, 0, 2, 0, a.block_size)],
                )
            assert bytes(b.region("host")) == before
            a.free_mem(src)

    run(main())
    run(cluster.close())


def test_dead_peer_fails_in_flight_transfers_and_frees_its_allocations() -> None:
    """MemServe 4.4 in process: the sender stops heartbeating mid-stream."""
    a, b = pool(1), pool(2)
    cluster = InProcessCluster(ttl_s=0.6, heartbeat_s=0.2)
    base_b = free_counts(b)

    async def main() -> None:
        async with agents(a, b, membership=cluster) as (ta, tb):
            src = src_blocks(a, 16)
            stream = await ta.open_stream(2, src, tokens=prompt(16))
            await stream.send_layers(0, 1)
            assert free_counts(b)["host"] == base_b["host"] - 4
            cluster._beats.pop(1).cancel()  # instance 1 stalls: its record expires
            for _ in range(40):
                if free_counts(b) == base_b:
                    break
                await asyncio.sleep(0.05)
            assert free_counts(b) == base_b and tb.session_count() == 0
            with pytest.raises(TransferFailed, match="instance 2"):
                await stream.send_layers(1, 3)
            a.free_mem(src)

    run(main())


def test_allocations_held_past_the_deadline_are_freed() -> None:
    """A live sender that never commits does not pin the receiver's blocks forever."""
    a, b = pool(1), pool(2)
    base_b = free_counts(b)

    async def main() -> None:
        async with agents(a, b, options=[{}, {"pending_timeout_s": 0.3}]) as (ta, tb):
            src = src_blocks(a, 16)
            stream = await ta.open_stream(2, src, tokens=prompt(16))
            await stream.send_layers()
            assert free_counts(b)["host"] == base_b["host"] - 4
            took = await eventually(lambda: free_counts(b) == base_b, 2.0)
            assert took > 0.25 and not tb.grants._granted
            with pytest.raises(InvalidRequest, match=r"unknown here.*expired after 0\.3s"):
                await stream.finish()
            assert b.match(prompt(16)).num_tokens == 0 and tb.session_count() == 1
            a.free_mem(src)

    run(main())


def test_aborted_stream_frees_at_once_and_bad_private_is_refused() -> None:
    a, b = pool(1), pool(2)
    base_b = free_counts(b)

    async def main() -> None:
        async with agents(a, b) as (ta, tb):
            src = src_blocks(a, 16)
            with pytest.raises(RuntimeError, match="engine failed"):
                async with await ta.open_stream(2, src, tokens=prompt(16)) as stream:
                    await stream.send_layers(0, 1)
                    raise RuntimeError("engine failed mid-prefill")
            await eventually(lambda: free_counts(b) == base_b, 1.0)
            assert tb.session_count() == 1 and b.stats()["protected_pages"] == 0
            with pytest.raises(InvalidRequest, match="finished or aborted"):
                await stream.send_layers(1, 2)
            with pytest.raises(InvalidRequest, match="msgpack-serializable"):
                await ta.transfer(2, src, private=object())
            assert free_counts(b) == base_b
            a.free_mem(src)

    run(main())
