"""The Replicator against a real redis-server, several replicas in one process: operations
and load flow between them, a late replica catches up from a snapshot plus the stream, and
a Redis killed and restarted mid-run costs nothing but a pause in the sharing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.replicas import ReplicaConfig, Replicator
from router.replicas.trees import ReplicatedTrees
from router.workers import BreakerConfig, Worker, WorkerRegistry, WorkerType
from tests.conftest import RedisServer, start_redis, stop_redis

W1, W2, W3 = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
C = WorkerType.COLOCATED


def replica(url: str, name: str, added: list[str] | None = None) -> Replicator:
    trees = ReplicatedTrees(page_size=4)
    registry = WorkerRegistry(BreakerConfig())
    for w in (W1, W2):
        registry.add(w)

    async def on_added(worker: Worker) -> None:
        if added is not None:
            added.append(worker.url)

    config = ReplicaConfig(
        url,
        name,
        namespace="t",
        block_ms=200,
        load_interval_s=0.05,
        load_ttl_s=0.3,
        snapshot_interval_s=0.5,
    )
    rep = Replicator(config, trees, registry, CollectorRegistry(), on_added)
    rep.start()
    return rep


async def until(check: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `check()` held; AssertionError after `timeout`."""
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


def same_trees(*reps: Replicator) -> Callable[[], bool]:
    return lambda: all(r.trees.holder_pages() == reps[0].trees.holder_pages() for r in reps)


def test_operations_load_and_workers_flow_between_replicas(redis_url: str) -> None:
    async def run() -> None:
        added: list[str] = []
        a, b = replica(redis_url, "a"), replica(redis_url, "b", added)
        try:
            await until(lambda: a.synced and b.synced)
            a.trees.record(C, W1, list(range(12)))
            delay = await until(lambda: bool(b.trees.holder_pages()))
            print(f"\nreplica b applied a's record after {delay * 1000:.1f} ms")
            assert b.trees.holder_pages() == {"colocated": {W1: 3}}
            # applied, not re-published (b's own periodic load report may be queued)
            assert {op.op for op in b.outbox.take(10_000)} <= {"load"}
            b.trees.drop(C, W1, list(range(12)), 4)
            # (the two dropped pages stay W1's home)
            await until(lambda: a.trees.holder_pages() == {"colocated": {W1: 1, f"{W1}#home": 3}})

            a.registry.workers[W2].in_flight = 3
            a.registry.workers[W2].in_flight_tokens = 900
            w2 = b.registry.workers[W2]
            await until(lambda: w2.peer_in_flight == 3 and w2.load == 3)
            assert w2.queued_tokens == 900 and b.registry.workers[W1].load == 0
            assert b.peers == ["a"]

            a.worker_added(a.registry.add(W3))
            await until(lambda: W3 in b.registry.workers and added == [W3])
            a.registry.remove(W3)
            a.worker_removed(W3)
            await until(lambda: W3 not in b.registry.workers)
            assert await a.flush()
            assert a.published >= 3 and b.applied >= 3  # record, add, remove, and loads
            await a.stop()  # a replica gone quiet stops counting
            await until(lambda: w2.peer_in_flight == 0 and b.peers == [])
        finally:
            await a.stop()
            await b.stop()
        assert a.health.outages == b.health.outages == 0

    asyncio.run(run())


def test_a_late_replica_catches_up_from_snapshot_and_stream(redis_url: str) -> None:
    async def run() -> None:
        import redis.asyncio as aioredis

        a = replica(redis_url, "a")
        late: Replicator | None = None
        client = aioredis.Redis.from_url(redis_url)
        try:
            await until(lambda: a.synced)
            for i in range(20):
                a.trees.record(C, W1 if i % 2 else W2, [i, *range(100, 100 + 4 * i)])
            assert await a.flush()
            await until(lambda: a.cursor != "0")  # its reader has passed its own ops
            assert await a.write_snapshot(force=True)
            snapshot_id = a.cursor
            a.trees.drop(C, W1, [1, *range(100, 104)], 0)  # after the snapshot: stream only
            a.trees.record(C, W2, [7] * 40)
            assert await a.flush()
            # what the snapshot covers is trimmed away, as MAXLEN would
            await client.xtrim("t:trees", minid=snapshot_id)
            late = replica(redis_url, "late")
            delay = await until(same_trees(a, late))
            print(f"\nlate replica converged in {delay * 1000:.1f} ms")
            assert late.trees.holder_pages()["colocated"][W2] > 0
        finally:
            await client.aclose()
            await a.stop()
            if late is not None:
                await late.stop()

    asyncio.run(run())


def test_redis_killed_and_restarted(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servers = [redis_server]

    async def run() -> None:
        a, b = replica(redis_server.url, "a"), replica(redis_server.url, "b")
        try:
            await until(lambda: a.synced and b.synced)
            a.trees.record(C, W1, list(range(8)))
            await until(same_trees(a, b))
            os.kill(redis_server.proc.pid, signal.SIGKILL)
            redis_server.proc.wait()
            await until(lambda: not a.health.up and not b.health.up)
            a.trees.record(C, W2, list(range(50, 66)))  # queued while Redis is away
            b.trees.record(C, W1, list(range(200, 216)))
            await asyncio.sleep(0.5)
            servers.append(start_redis(tmp_path, port=redis_server.port))
            delay = await until(same_trees(a, b), timeout=10)
            print(f"\nreplicas converged {delay * 1000:.0f} ms after Redis restarted")
            assert a.health.up and b.health.up
            assert a.trees.holder_pages() == {"colocated": {W1: 6, W2: 4}}
            a.trees.record(C, W2, list(range(300, 320)))  # new updates flow again
            await until(same_trees(a, b))
            assert a.health.outages == b.health.outages == 1
        finally:
            await a.stop()
            await b.stop()

    with caplog.at_level(logging.WARNING, logger="router.replicas.sync"):
        try:
            asyncio.run(run())
        finally:
            for s in servers[1:]:
                stop_redis(s)
    down = [r for r in caplog.records if "serving from local state" in r.getMessage()]
    back = [r for r in caplog.records if "resynchronising" in r.getMessage()]
    assert len(down) == len(back) == 2  # once per replica each way
