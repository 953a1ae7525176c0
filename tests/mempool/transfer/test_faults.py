"""Failures with real processes (MemServe 4.4): a peer killed or frozen mid-transfer, a sender
killed after the receiver allocated, a sender declared dead by Redis. Nothing hangs (every
wait is bounded by the agents' timeouts), errors name the peer, and the allocators' free
counts return to their baseline."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from mempool import MemPool
from mempool.transfer.agent import TransferAgent
from mempool.transfer.base import PeerInfo, TransferFailed
from mempool.transfer.membership import RedisCluster

from .agents import agents, run
from .kv import alloc, free_counts
from .peer_proc import HEARTBEAT_S, SPEC, TTL_S, tokens
from .procpeer import eventually, peer_process


def pool(instance: int) -> MemPool:
    return MemPool(instance, SPEC, host_blocks=256)


async def know(agent: TransferAgent, peer_id: int, port: int) -> None:
    await agent.add_peer(PeerInfo(peer_id, "127.0.0.1", port))


def test_receiver_killed_mid_transfer(tmp_path: Path) -> None:
    a = pool(1)
    base = free_counts(a)

    async def main() -> None:
        async with (
            peer_process(tmp_path, "--instance", "2", "--role", "receiver") as peer,
            agents(a) as (ta,),
        ):
            await know(ta, 2, peer.ready["port"])
            src = alloc(a, 8)
            stream = await ta.open_stream(2, src, tokens=tokens(128))
            await stream.send_layers(0, 1)
            peer.kill()
            start = time.monotonic()
            with pytest.raises(TransferFailed, match="instance 2"):
                await stream.send_layers(1, SPEC.layers)
            with pytest.raises(TransferFailed, match=r"instance 2.*unreachable"):
                await ta.transfer(2, src)
            assert time.monotonic() - start < 2.5
            a.free_mem(src)

    run(main())
    assert free_counts(a) == base


def test_frozen_receiver_times_out_instead_of_hanging(tmp_path: Path) -> None:
    a = pool(1)

    async def main() -> None:
        async with (
            peer_process(tmp_path, "--instance", "2", "--role", "receiver") as peer,
            agents(a, timeout_s=1.0) as (ta,),
        ):
            await know(ta, 2, peer.ready["port"])
            src = alloc(a, 8)
            stream = await ta.open_stream(2, src)
            peer.signal(signal.SIGSTOP)  # alive, sockets open, never answering
            start = time.monotonic()
            with pytest.raises(TransferFailed, match=r"instance 2 at 127\.0\.0\.1:.*no progress"):
                await stream.send_layers()
            assert 0.9 < time.monotonic() - start < 2.5
            with pytest.raises(TransferFailed, match="instance 2"):
                await ta.transfer(2, src)  # the link was dropped: fails, again bounded
            assert time.monotonic() - start < 5
            a.free_mem(src)

    run(main())


def test_sender_killed_after_the_receiver_allocated(tmp_path: Path) -> None:
    b = pool(2)
    base = free_counts(b)

    async def main() -> None:
        async with agents(b) as (tb,):
            prefix = alloc(b, 2)
            b.insert(tokens(32), prefix)  # the sender's prompt shares 2 cached pages
            sender = ("--instance", "1", "--role", "sender", "--target", "2", "--tokens", "100")
            async with peer_process(tmp_path, *sender, "--target-port", str(tb.port)) as peer:
                assert peer.ready == {"allocated": 5}  # 7 pages, 2 cached
                assert free_counts(b)["host"] == base["host"] - 2 - 5
                assert b.stats()["protected_pages"] == 2  # the matched prefix is locked
                assert tb.session_count() == 1
                peer.kill()
                await eventually(lambda: tb.session_count() == 0, 2.0)
            assert free_counts(b)["host"] == base["host"] - 2
            assert b.stats()["protected_pages"] == 0 and not tb.grants._granted
            b.flush()

    run(main())
    assert free_counts(b) == base


def test_frozen_sender_is_declared_dead_through_redis(tmp_path: Path, redis_url: str) -> None:
    b = pool(2)
    base = free_counts(b)
    cluster = RedisCluster(redis_url, ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S)

    async def main() -> None:
        sender = ("--instance", "1", "--role", "sender", "--target", "2", "--redis", redis_url)
        async with (
            agents(b, membership=cluster) as (tb,),
            peer_process(tmp_path, *sender) as peer,
        ):
            assert peer.ready == {"allocated": 4}
            assert free_counts(b)["host"] == base["host"] - 4
            peer.signal(signal.SIGSTOP)  # its connection stays open; its heartbeats stop
            took = await eventually(lambda: free_counts(b) == base, TTL_S + 2.0)
            assert took > TTL_S / 2 and tb.session_count() == 0
            src = alloc(b, 1)
            with pytest.raises(TransferFailed, match="instance 1 is not a live member"):
                await tb.transfer(1, src)
            b.free_mem(src)
        await cluster.close()

    run(main())
    assert free_counts(b) == base


def test_pull_from_a_frozen_holder_fails_and_leaks_nothing(tmp_path: Path) -> None:
    a = pool(1)
    base = free_counts(a)

    async def main() -> None:
        async with (
            peer_process(tmp_path, "--instance", "2", "--role", "receiver") as peer,
            agents(a, timeout_s=1.0) as (ta,),
        ):
            await know(ta, 2, peer.ready["port"])
            src = alloc(a, 4)
            await ta.transfer_with_insert(2, tokens(64), src)  # the holder caches it
            a.free_mem(src)
            peer.signal(signal.SIGSTOP)
            with pytest.raises(TransferFailed, match=r"instance 2.*no reply to lock"):
                await ta.pull(2, tokens(64))
            assert a.stats()["protected_pages"] == 0

    run(main())
    assert free_counts(a) == base
