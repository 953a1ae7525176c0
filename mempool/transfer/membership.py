"""Cluster membership (MemServe 4.4's cluster manager): who is alive and how to reach them.

Instances `join` with their PeerInfo and heartbeat; a record that is not refreshed within the
TTL disappears, and a watcher tells subscribers (`on_dead`) which instances went, so each
instance frees the blocks it allocated for their unfinished transfers. Two stores: in-process
(tests, one-process clusters) and Redis (keys with a TTL that heartbeats refresh; a missing key
is a dead instance). When the store is unreachable, calls raise MembershipUnavailable at once
(bounded timeouts, no retries loops) and nobody is declared dead on that account: an outage
of the registry says nothing about the instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from mempool.transfer.base import PeerInfo, TransferFailed

log = logging.getLogger(__name__)

DeadCallback = Callable[[int], Awaitable[None] | None]


class MembershipError(TransferFailed):
    """Membership could not answer (the store is down, or the instance is not registered)."""


class UnknownPeer(MembershipError, LookupError):
    """No live instance has this id: it never joined, left, or stopped heartbeating."""


class MembershipUnavailable(MembershipError, ConnectionError):
    """The membership store cannot be reached."""


class ClusterManager(ABC):
    """Register, heartbeat, look up and watch instances. Subclasses provide the store."""

    def __init__(self, ttl_s: float = 3.0, heartbeat_s: float = 1.0) -> None:
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be positive and below ttl_s")
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self._callbacks: list[DeadCallback] = []
        self._joined: dict[int, PeerInfo] = {}
        self._beats: dict[int, asyncio.Task[None]] = {}
        self._known: set[int] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._down = False

    # ----------------------------------------------------------------- store (subclasses)

    @abstractmethod
    async def register(self, info: PeerInfo) -> None:
        """Publish (or refresh) an instance's record for ttl_s."""

    @abstractmethod
    async def deregister(self, instance_id: int) -> None:
        """Remove an instance's record (it leaves)."""

    @abstractmethod
    async def lookup(self, instance_id: int) -> PeerInfo:
        """The live record of an instance; UnknownPeer if it has none."""

    @abstractmethod
    async def peers(self) -> list[PeerInfo]:
        """Every live record."""

    async def heartbeat(self, instance_id: int) -> None:
        """Refresh a joined instance's record (re-publishing it if it had expired)."""
        info = self._joined.get(instance_id)
        if info is None:
            raise UnknownPeer(f"instance {instance_id} has not joined through this manager")
        await self.register(info)

    # ----------------------------------------------------------------- lifecycle

    async def join(self, info: PeerInfo) -> None:
        """Register and keep heartbeating until `leave`; starts the dead-peer watcher."""
        await self.register(info)
        self._joined[info.instance_id] = info
        old = self._beats.pop(info.instance_id, None)
        if old is not None:
            old.cancel()
        self._beats[info.instance_id] = asyncio.create_task(self._beat(info.instance_id))
        self.start()

    async def leave(self, instance_id: int) -> None:
        task = self._beats.pop(instance_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._joined.pop(instance_id, None)
        with contextlib.suppress(MembershipError):
            await self.deregister(instance_id)

    def on_dead(self, callback: DeadCallback) -> None:
        """Call `callback(instance_id)` when an instance's record disappears."""
        self._callbacks.append(callback)

    def remove_callback(self, callback: DeadCallback) -> None:
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def start(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        for instance_id in list(self._beats):
            await self.leave(instance_id)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None

    # ----------------------------------------------------------------- internals

    async def _beat(self, instance_id: int) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.heartbeat(instance_id)
            except MembershipError as exc:
                if not failing:  # once per outage, not once per beat
                    log.warning("membership: heartbeats of instance %d fail: %s", instance_id, exc)
                failing = True
                continue
            if failing:
                log.warning("membership: heartbeats of instance %d resumed", instance_id)
            failing = False

    async def check(self) -> set[int]:
        """Compare live records with the last check; fire callbacks for the missing ones."""
        try:
            live = {p.instance_id for p in await self.peers()}
        except MembershipUnavailable as exc:
            if not self._down:
                log.warning("membership: %s; nobody is declared dead meanwhile", exc)
            self._down = True
            return set()
        self._down = False
        gone = self._known - live
        self._known = live
        for instance_id in sorted(gone):
            await self._fire(instance_id)
        return gone

    async def _fire(self, instance_id: int) -> None:
        log.info("membership: instance %d is gone", instance_id)
        for callback in list(self._callbacks):
            try:
                result = callback(instance_id)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a subscriber's bug must not stop the others
                log.exception("membership: dead-peer callback failed for %d", instance_id)

    async def _watch(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.heartbeat_s / 2)


class InProcessCluster(ClusterManager):
    """Membership held in this process: records expire ttl_s after their last heartbeat."""

    def __init__(
        self,
        ttl_s: float = 3.0,
        heartbeat_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ttl_s, heartbeat_s)
        self.clock = clock
        self._records: dict[int, tuple[PeerInfo, float]] = {}

    async def register(self, info: PeerInfo) -> None:
        self._records[info.instance_id] = (info, self.clock() + self.ttl_s)

    async def deregister(self, instance_id: int) -> None:
        self._records.pop(instance_id, None)

    async def lookup(self, instance_id: int) -> PeerInfo:
        record = self._records.get(instance_id)
        if record is None or record[1] < self.clock():
            raise UnknownPeer(f"instance {instance_id} is not a live member of the cluster")
        return record[0]

    async def peers(self) -> list[PeerInfo]:
        now = self.clock()
        for dead in [i for i, (_, expiry) in self._records.items() if expiry < now]:
            del self._records[dead]
        return [info for info, _ in self._records.values()]


class RedisCluster(ClusterManager):
    """Membership in Redis: one key per instance, `PX ttl`, re-set by every heartbeat."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "mempool",
        ttl_s: float = 3.0,
        heartbeat_s: float = 1.0,
        timeout_s: float = 1.0,
    ) -> None:
        super().__init__(ttl_s, heartbeat_s)
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._codec = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(PeerInfo)

    def _key(self, instance_id: int) -> str:
        return f"{self.prefix}:peer:{instance_id}"

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:  # redis replies: bytes
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            raise MembershipUnavailable(
                f"{what} failed: membership store {self.url} unreachable: {why}"
            ) from None

    async def register(self, info: PeerInfo) -> None:
        px = max(1, int(self.ttl_s * 1000))
        value = self._codec.encode(info)
        what = f"register of instance {info.instance_id}"
        await self._call(what, self._redis.set(self._key(info.instance_id), value, px=px))

    async def deregister(self, instance_id: int) -> None:
        what = f"deregister of instance {instance_id}"
        await self._call(what, self._redis.delete(self._key(instance_id)))

    async def lookup(self, instance_id: int) -> PeerInfo:
        what = f"lookup of instance {instance_id}"
        raw = await self._call(what, self._redis.get(self._key(instance_id)))
        if raw is None:
            raise UnknownPeer(
                f"instance {instance_id} is not a live member of the cluster ({self.url})"
            )
        return self._decoder.decode(raw)

    async def peers(self) -> list[PeerInfo]:
        keys = []

        async def scan() -> None:
            async for key in self._redis.scan_iter(match=f"{self.prefix}:peer:*", count=500):
                keys.append(key)

        await self._call("listing members", scan())
        if not keys:
            return []
        values = await self._call("listing members", self._redis.mget(keys))
        return [self._decoder.decode(v) for v in values if v is not None]

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(Exception):
            await self._redis.aclose()
