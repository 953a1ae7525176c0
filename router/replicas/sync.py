"""Router replicas sharing state through Redis: tree operations, in-flight load, registry.

Every replica keeps its prompt trees and worker registry in memory and decides alone; Redis
only carries what changed, off every request's path:

- Its tree operations and worker additions/removals go into a bounded outbox that a
  publisher drains into the stream `{ns}:trees` (XADD MAXLEN ~). A reader on its own
  connection XREADs the stream from its cursor and applies the others' operations.
- Its in-flight counts per worker go into the same stream a few milliseconds after they
  change (and every `load_interval_s`); a worker's load is its own count plus the others'
  last ones, forgotten when a replica has said nothing for `load_ttl_s`.
- One replica at a time (a `SET NX PX` lease) writes `{ns}:snapshot`: its trees' holders
  and the stream id they cover. A replica that starts (or restarts) applies it, then reads
  the stream from that id.

Redis down: every loop backs off (jittered, capped), the replica serves from its own state
and says so once; when Redis answers again it says so once, and if Redis restarted (its
run_id changed) the cursor goes back to the new stream's start and a snapshot is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.replicas.ops import (
    ADD_WORKER,
    LOAD,
    REMOVE_WORKER,
    VERSION,
    Dedupe,
    Op,
    Outbox,
    Snapshot,
    WorkerEntry,
    decode_op,
    decode_snapshot,
    encode,
)
from router.replicas.trees import ReplicatedTrees
from router.workers import Worker, WorkerRegistry, WorkerType

log = logging.getLogger(__name__)
BATCH = 500  # ops per pipeline (publisher) or XREAD (reader)
BACKOFF_CAP_S = 2.0


def new_replica_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(slots=True)
class ReplicaConfig:
    redis_url: str
    replica_id: str
    namespace: str = "memserve"
    stream_maxlen: int = 100_000  # approximate: XADD MAXLEN ~
    queue_size: int = 10_000  # ops waiting to be published; more are dropped and counted
    block_ms: int = 1000  # the reader's XREAD BLOCK
    load_poll_s: float = 0.005  # in-flight counts are published this soon after a change
    load_interval_s: float = 0.5  # and at least this often
    load_ttl_s: float = 2.0  # a replica silent this long no longer counts
    snapshot_interval_s: float = 10.0
    timeout_s: float = 1.0  # every call but the blocking read


class ReplicaMetrics:
    """memserve_router_replica_* and memserve_router_redis_up."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        prefix = "memserve_router_replica"
        self.published = Counter(f"{prefix}_ops_published", "Ops written to Redis", registry=r)
        self.applied = Counter(f"{prefix}_ops_applied", "Other replicas' ops applied", registry=r)
        self.dropped = Counter(
            f"{prefix}_ops_dropped", "Ops not published: the outbox was full", registry=r
        )
        self.redis_up = Gauge("memserve_router_redis_up", "1 when Redis answers", registry=r)
        self.lag = Histogram(
            f"{prefix}_lag_seconds",
            "Apply time minus publish time of other replicas' ops",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.snapshots = Counter(f"{prefix}_snapshots_written", "Snapshots written", registry=r)


class RedisHealth:
    """Whether Redis answers, told once per change (not once per failed call)."""

    def __init__(self, replica: str, url: str, metrics: ReplicaMetrics) -> None:
        self.replica = replica
        self.url = url
        self.metrics = metrics
        self.up = True
        self.outages = 0
        metrics.redis_up.set(1)

    def ok(self) -> bool:
        """Redis answered; True when it had been down (resynchronise)."""
        if self.up:
            return False
        self.up = True
        self.metrics.redis_up.set(1)
        log.warning("replica %s: redis back at %s: resynchronising", self.replica, self.url)
        return True

    def failed(self, exc: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        self.outages += 1
        self.metrics.redis_up.set(0)
        why = str(exc) or type(exc).__name__
        log.warning(
            "replica %s: redis unreachable at %s (%s): serving from local state",
            self.replica,
            self.url,
            why,
        )


class Backoff:
    """Jittered exponential delays, capped; reset after a success."""

    def __init__(self, first_s: float = 0.05, cap_s: float = BACKOFF_CAP_S) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.n = 0

    def next(self) -> float:
        delay = min(self.cap_s, self.first_s * float(2**self.n))
        self.n += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.n = 0


def _redis_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError)


class Replicator:
    """Publishes this replica's changes, applies the others', shares in-flight load."""

    def __init__(
        self,
        config: ReplicaConfig,
        trees: ReplicatedTrees,
        registry: WorkerRegistry,
        metrics_registry: CollectorRegistry,
        on_worker_added: Callable[[Worker], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.config = config
        self.id = config.replica_id
        self.trees = trees
        self.registry = registry
        self.on_worker_added = on_worker_added
        self.metrics = ReplicaMetrics(metrics_registry)
        self.health = RedisHealth(self.id, config.redis_url, self.metrics)
        self.outbox = Outbox(self.id, random.getrandbits(63), config.queue_size)
        trees.outbox = self.outbox
        self.dedupe = Dedupe()
        ns = config.namespace
        self.stream = f"{ns}:trees"
        self.snapshot_key = f"{ns}:snapshot"
        self.lease_key = f"{ns}:snapshot:lease"
        self.cursor = "0"  # the last stream id applied
        self.run_id: str | None = None  # Redis's: a new one means it restarted
        self.synced = False  # the start-up snapshot was applied (or there was none)
        self.applied = 0
        self.published = 0
        self._dropped_counted = 0
        # other replicas' last published in-flight counts: when received, per worker URL
        self._peer_loads: dict[tuple[str, int], tuple[float, dict[str, list[int]]]] = {}
        self._snapshot_now = asyncio.Event()
        self._sending = False  # the publisher holds a batch not yet written
        self._stopped = False
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Task[None]] = set()

        def client(timeout_s: float) -> Any:
            return aioredis.Redis.from_url(
                config.redis_url,
                socket_connect_timeout=config.timeout_s,
                socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1),  # once: a pooled connection may predate a restart
            )

        self._writer = client(config.timeout_s)
        self._reader = client(config.block_ms / 1000 + 2 * config.timeout_s)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._guarded(name, run))
            for name, run in (
                ("publisher", self._publish_loop),
                ("reader", self._read_loop),
                ("load", self._load_loop),
                ("snapshot", self._snapshot_loop),
            )
        ]

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.health.up:  # what this replica just learned is worth a moment
            self.outbox.emit(LOAD, loads={})  # and it sends nothing any more
            await self.flush(0.5)
        self._closing = True  # loops end at their next turn, should a cancel go astray
        pending = {*self._tasks, *self._spawned}
        for _ in range(5):  # redis-py can turn a cancel into a TimeoutError: cancel again
            for task in pending:
                task.cancel()
            if not pending:
                break
            _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending:
            log.warning("replica %s: %d loops did not stop", self.id, len(pending))
        for client in (self._writer, self._reader):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _guarded(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A loop that a bug must not end silently: logged, restarted after a pause."""
        while not self._closing:
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replica %s loop failed; restarting it", name)
                await asyncio.sleep(1.0)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # ----------------------------------------------------------------- registry ops

    def worker_added(self, worker: Worker) -> None:
        """Added through this replica's API: the others add it too."""
        port, model = worker.bootstrap_port, worker.model_id
        self.outbox.emit(
            ADD_WORKER, url=worker.url, type=worker.type.value, bootstrap_port=port, model_id=model
        )

    def worker_removed(self, url: str) -> None:
        self.outbox.emit(REMOVE_WORKER, url=url)

    def _add_worker(
        self, url: str, type: str, bootstrap_port: int | None, model_id: str | None
    ) -> None:
        try:
            worker = self.registry.add(url, WorkerType(type), bootstrap_port)
        except ValueError:  # already there (its own config, or added twice), or malformed
            return
        worker.model_id = model_id
        log.info("replica: worker %s added by another replica", worker.url)
        if self.on_worker_added is not None:
            self._spawn(self.on_worker_added(worker))

    def _remove_worker(self, url: str) -> None:
        with self.trees.applying(), contextlib.suppress(KeyError, ValueError):
            self.registry.remove(url)
            log.info("replica: worker %s removed by another replica", url)

    # ----------------------------------------------------------------- publishing

    async def _publish_loop(self) -> None:
        backoff = Backoff()
        batch: list[Op] = []
        maxlen = self.config.stream_maxlen
        while not self._closing:
            if not batch:
                self._sending = False
                batch = [await self.outbox.queue.get()]
                self._sending = True
                batch += self.outbox.take(BATCH - 1)
            # load reports that waited out an outage say nothing true any more
            oldest = time.time() - self.config.load_ttl_s
            batch = [op for op in batch if op.op != LOAD or op.ts > oldest]
            if not batch:
                continue
            try:
                pipe = self._writer.pipeline(transaction=False)
                for op in batch:
                    pipe.xadd(self.stream, {"m": encode(op)}, maxlen=maxlen, approximate=True)
                await pipe.execute()
            except _redis_errors() as exc:
                self.health.failed(exc)
                await asyncio.sleep(backoff.next())
                continue  # the same batch again: readers drop what did arrive twice
            self.published += len(batch)
            self.metrics.published.inc(len(batch))
            self._sync_dropped()
            batch = []
            backoff.reset()
            if self.health.ok():
                self._snapshot_now.set()

    async def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until every queued op is published (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.outbox.queue.empty() or self._sending:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    def _sync_dropped(self) -> None:
        lost = self.outbox.dropped - self._dropped_counted
        if lost > 0:
            self.metrics.dropped.inc(lost)
            self._dropped_counted += lost

    # ----------------------------------------------------------------- reading

    async def _read_loop(self) -> None:
        backoff = Backoff()
        resync = True
        while not self._closing:
            try:
                if resync:
                    await self._resync()
                    resync = False
                reply = await self._reader.xread(
                    {self.stream: self.cursor}, count=BATCH, block=self.config.block_ms
                )
            except _redis_errors() as exc:
                self.health.failed(exc)
                resync = True
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self.health.ok()
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self.cursor = _text(entry_id)
                    raw = fields.get(b"m")
                    if raw is not None:
                        self._apply_raw(raw)

    async def _resync(self) -> None:
        """(Re)connected: first time, apply the snapshot and read on from its stream id;
        after a Redis restart, read the new stream from its start and write a snapshot."""
        info = await self._reader.info("server")
        run_id = str(info.get("run_id", ""))
        if self.run_id is not None and run_id != self.run_id:
            log.warning("redis restarted (new run_id): reading its stream from the start")
            self.cursor = "0"
            self._snapshot_now.set()
        self.run_id = run_id
        if self.synced:
            return
        raw = await self._reader.get(self.snapshot_key)
        if raw is not None:
            try:
                snap = decode_snapshot(raw)
            except ValueError:
                log.warning("replica: undecodable snapshot at %s ignored", self.snapshot_key)
            else:
                self._load_snapshot(snap)
        self.synced = True

    def _load_snapshot(self, snap: Snapshot) -> None:
        for w in snap.workers:
            self._add_worker(w.url, w.type, w.bootstrap_port, w.model_id)
        n = self.trees.load(snap.entries)
        self.cursor = snap.stream_id
        age = time.time() - snap.created
        log.info(
            "replica: snapshot of %s applied (%d entries, %.1f s old), stream from %s",
            snap.replica,
            n,
            age,
            snap.stream_id,
        )

    def _apply_raw(self, raw: bytes) -> None:
        try:
            op = decode_op(raw)
        except ValueError:
            log.debug("replica: undecodable op skipped")
            return
        if op.replica == self.id and op.inc == self.outbox.inc:
            return  # our own
        if op.v != VERSION or not self.dedupe.fresh(op):
            return
        self.apply(op)

    def apply(self, op: Op) -> None:
        """One of another replica's operations, applied here without re-publishing."""
        if op.op == ADD_WORKER:
            self._add_worker(op.url, op.type, op.bootstrap_port, op.model_id)
        elif op.op == REMOVE_WORKER:
            self._remove_worker(op.url)
        elif op.op == LOAD:
            self._apply_load(op)
        elif not self.trees.apply(op):
            return
        self.applied += 1
        self.metrics.applied.inc()
        if op.ts:
            self.metrics.lag.observe(max(time.time() - op.ts, 0.0))

    # ----------------------------------------------------------------- load

    async def _load_loop(self) -> None:
        """Publish this replica's in-flight counts when they change (checked every
        `load_poll_s`) and at least every `load_interval_s`; forget silent peers' counts."""
        cfg = self.config
        last: dict[str, list[int]] | None = None
        sent = 0.0
        while not self._closing:
            await asyncio.sleep(cfg.load_poll_s)
            now = time.monotonic()
            own = {w.url: [w.in_flight, w.in_flight_tokens] for w in self.registry.workers.values()}
            if self.health.up and (own != last or now - sent >= cfg.load_interval_s):
                self.outbox.emit(LOAD, loads=own)
                last, sent = own, now
            stale = [k for k, (seen, _) in self._peer_loads.items() if now - seen > cfg.load_ttl_s]
            if stale:
                for key in stale:
                    del self._peer_loads[key]
                self._sum_peer_loads()

    def _apply_load(self, op: Op) -> None:
        self._peer_loads[(op.replica, op.inc)] = (time.monotonic(), op.loads or {})
        self._sum_peer_loads()

    def _sum_peer_loads(self) -> None:
        """Each worker's peer_in_flight: the sum of the live peers' last published counts."""
        set_peer_loads(self.registry, (loads for _, loads in self._peer_loads.values()))
        self.registry.load_changed()

    @property
    def peers(self) -> list[str]:
        """Other replicas that published their load within load_ttl_s."""
        return sorted({replica for replica, _ in self._peer_loads})

    # ----------------------------------------------------------------- snapshots

    async def _snapshot_loop(self) -> None:
        interval = self.config.snapshot_interval_s
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._snapshot_now.wait(), interval)
            self._snapshot_now.clear()
            if not self.synced:
                continue  # our trees may lack what the current snapshot has
            try:
                await self.write_snapshot()
            except _redis_errors() as exc:
                self.health.failed(exc)

    async def write_snapshot(self, force: bool = False) -> bool:
        """Write the snapshot if this replica holds the lease (or `force`); True if written."""
        px = max(1, int(self.config.snapshot_interval_s * 1000 * 0.9))
        if not force and not await self._writer.set(self.lease_key, self.id, nx=True, px=px):
            return False
        cursor, taken = self.cursor, time.time()  # before the walk: what follows is replayed
        snap = Snapshot(
            VERSION,
            self.id,
            cursor,
            taken,
            await self.trees.snapshot_async(),
            [
                WorkerEntry(w.url, w.type.value, w.bootstrap_port, w.model_id)
                for w in self.registry.workers.values()
            ],
        )
        await self._writer.set(self.snapshot_key, encode(snap))
        self.metrics.snapshots.inc()
        return True

    # ----------------------------------------------------------------- reporting

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "redis_up": self.health.up,
            "outages": self.health.outages,
            "peers": self.peers,
            "cursor": self.cursor,
            "synced": self.synced,
            "published": self.published,
            "applied": self.applied,
            "dropped": self.outbox.dropped,
            "queued": self.outbox.queue.qsize(),
        }


def set_peer_loads(registry: WorkerRegistry, peers: Iterable[dict[str, list[int]]]) -> None:
    """Each worker's peer_in_flight (and tokens): the sum of the peers' last counts, each
    {worker URL: [requests, prompt tokens]} (other replicas', or sibling processes')."""
    totals: dict[str, list[int]] = {}
    for loads in peers:
        for url, (n, tokens) in loads.items():
            total = totals.setdefault(url, [0, 0])
            total[0] += n
            total[1] += tokens
    for w in registry.workers.values():
        w.peer_in_flight, w.peer_in_flight_tokens = totals.get(w.url, (0, 0))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
