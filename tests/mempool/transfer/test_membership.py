"""Membership: records with a TTL refreshed by heartbeats, lookups, dead-peer callbacks, in
process and in a real redis-server; a Redis outage gives a clear error at once, declares nobody
dead and leaves connected peers working."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mempool import KVBlockSpec, MemPool
from mempool.transfer.agent import TransferAgent
from mempool.transfer.base import PeerInfo, Region
from mempool.transfer.membership import (
    InProcessCluster,
    MembershipUnavailable,
    RedisCluster,
    UnknownPeer,
)
from tests.conftest import start_redis, stop_redis
from tests.procs import free_port

from .agents import agents, run
from .kv import alloc, free_counts

INFO = PeerInfo(
    5, "127.0.0.1", 4000, (Region(2, 1 << 40, 4096),), {"tcp": {"host": "127.0.0.1", "port": 1}}
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_in_process_records_expire_and_dead_callbacks_fire() -> None:
    clock = Clock()
    cluster = InProcessCluster(ttl_s=3, heartbeat_s=1, clock=clock)
    dead: list[int] = []
    later: list[int] = []

    async def async_callback(instance: int) -> None:
        later.append(instance)

    async def main() -> None:
        cluster.on_dead(dead.append)
        cluster.on_dead(async_callback)
        await cluster.register(INFO)
        await cluster.register(PeerInfo(6, "127.0.0.1", 4001))
        assert await cluster.lookup(5) == INFO
        assert await cluster.check() == set()
        clock.now += 2
        await cluster.register(PeerInfo(6, "127.0.0.1", 4001))  # 6 heartbeats, 5 does not
        clock.now += 2
        assert await cluster.check() == {5}
        assert dead == [5] and later == [5]
        with pytest.raises(UnknownPeer, match="instance 5 is not a live member"):
            await cluster.lookup(5)
        assert [p.instance_id for p in await cluster.peers()] == [6]
        await cluster.deregister(6)  # leaving counts as gone too
        assert await cluster.check() == {6}
        with pytest.raises(UnknownPeer, match="has not joined"):
            await cluster.heartbeat(7)

    run(main())
    with pytest.raises(ValueError, match="heartbeat_s"):
        InProcessCluster(ttl_s=1, heartbeat_s=1)


def test_redis_records_live_while_heartbeating_and_vanish_after(redis_url: str) -> None:
    async def main() -> None:
        # five heartbeats per TTL: a loaded machine may delay one or two, never five
        watcher = RedisCluster(redis_url, ttl_s=1.0, heartbeat_s=0.2)
        member = RedisCluster(redis_url, ttl_s=1.0, heartbeat_s=0.2)
        gone: list[int] = []
        watcher.on_dead(gone.append)
        watcher.start()
        await member.join(INFO)
        assert await watcher.lookup(5) == INFO  # regions and endpoints round-trip
        await asyncio.sleep(0.3)
        assert await watcher.check() == set()  # known now
        await asyncio.sleep(1.3)  # longer than the TTL: heartbeats keep the key
        assert await watcher.lookup(5) == INFO and gone == []
        member._beats.pop(5).cancel()  # the instance stalls
        start = time.monotonic()
        while not gone and time.monotonic() - start < 4:
            await asyncio.sleep(0.05)
        assert gone == [5] and 0.4 < time.monotonic() - start < 3
        with pytest.raises(UnknownPeer, match="instance 5"):
            await watcher.lookup(5)
        await member.join(INFO)
        await member.leave(5)
        with pytest.raises(UnknownPeer):
            await watcher.lookup(5)
        await member.close()
        await watcher.close()

    run(main())


def test_redis_down_is_a_clear_error_not_a_hang() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def main() -> None:
        cluster = RedisCluster(url, ttl_s=1, heartbeat_s=0.3)
        start = time.monotonic()
        calls = {
            "register of instance 5": cluster.join(INFO),
            "lookup of instance 5": cluster.lookup(5),
            "listing members": cluster.peers(),
        }
        for what, call in calls.items():
            with pytest.raises(MembershipUnavailable, match=f"{what} failed: .*{url} unreachable"):
                await call
        assert await cluster.check() == set()  # an outage declares nobody dead
        pool = MemPool(1, KVBlockSpec(1, 1, 8, "float16", 4), host_blocks=4)
        agent = TransferAgent(pool, membership=cluster)
        with pytest.raises(MembershipUnavailable, match="unreachable"):
            await agent.start()
        assert time.monotonic() - start < 3
        await cluster.close()
        pool.close()  # the failed start released everything it had opened

    run(main())


def test_redis_dying_under_running_agents(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    spec = KVBlockSpec(2, 2, 8, "float16", 4)
    a, b, c = (MemPool(i, spec, host_blocks=32) for i in (1, 2, 3))
    clusters = [RedisCluster(server.url, ttl_s=1.0, heartbeat_s=0.25) for _ in range(3)]
    dead: list[int] = []

    async def main() -> None:
        async with agents(a, b, c, options=[{"membership": cl} for cl in clusters]) as (ta, _, _):
            clusters[0].on_dead(dead.append)
            src = alloc(a, 2)
            first = await ta.transfer(2, src)  # a is now connected to b
            stop_redis(server)
            start = time.monotonic()
            with pytest.raises(
                MembershipUnavailable, match=r"lookup of instance 3 failed: .* unreachable"
            ):
                await ta.transfer(3, src)  # needs a lookup: fails clearly, at once
            assert time.monotonic() - start < 2.5
            second = await ta.transfer(2, src)  # connected peers keep working
            await asyncio.sleep(1.5)  # past the TTL: an outage is no evidence of death
            third = await ta.transfer(2, src)
            assert dead == []
            b.free_mem(first.dst_addrs + second.dst_addrs + third.dst_addrs)
            a.free_mem(src)

    try:
        run(main())
    finally:
        stop_redis(server)
    assert free_counts(a) == free_counts(b) == {"host": 32}
