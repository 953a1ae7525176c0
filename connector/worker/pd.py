"""Prefill/decode disaggregation for the worker: SGLang's bootstrap handshake, KV by MemPool.

The router sends one request body, with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room`, to a prefill and a decode instance at once (SGLang's protocol). The decode
instance tells the prefill's bootstrap server where its MemPool agent listens (`POST
/rooms/{room}`); the prefill computes the prompt and its first token, then pushes the KV with
`transfer` or `transfer_with_insert` (MemServe figure 2), naming the room in `private`; the
decode instance picks the arrival up by room and decodes from there. Caching modes follow
MemServe table 4; PD-Caching-3 also writes the decode's KV back to the prefill instance.

Peers are known from the room claims (a static in-process table) or, with `cluster_redis`,
from shared membership in Redis (MemServe 4.4: heartbeats, dead instances' allocations
freed). A decode instance waiting for a room's KV gives up as soon as the prefill instance is
gone (its bootstrap server refuses connections, or membership declares it dead), not only at
the timeout. A `wire` model (the sim backend) adds the modelled time of the real bytes to
each transfer, between its allocation and its data, while the bytes moved are a stand-in.
A decode instance whose KV memory is held by its running requests refuses the allocation; the
prefill then keeps the KV pinned and offers it again until the decode has room or the
disaggregation timeout passes, as SGLang's prefill waits for its decode's pre-allocation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from mempool import MemPool, MemType, OutOfBlocks
from mempool.transfer.agent import TransferAgent, TransferResult
from mempool.transfer.base import DataTransport, PeerInfo, TransferFailed
from mempool.transfer.membership import ClusterManager, RedisCluster, UnknownPeer
from mempool.transfer.receiver import OnReceived, Received, TransferFlags
from shared.http_errors import json_error
from shared.pd_caching import Caching

log = logging.getLogger(__name__)
_peer_json = msgspec.json.Decoder(PeerInfo)
_encode = msgspec.json.encode


class PDMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class PDConfig:
    mode: PDMode = PDMode.NULL
    caching: Caching = Caching.CACHING_3
    transfer_backend: str = "mempool"  # or "fake": no KV moves (SGLang's test backend)
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    agent_host: str = "127.0.0.1"
    agent_port: int = 0
    secret: str | None = None
    timeout_s: float = 30.0  # longest wait for the other side of a room
    cluster_redis: str | None = None  # shared membership in Redis; None: peers from claims
    transport: str = "auto"  # MemPool data plane: auto (RDMA if a device exists), tcp, rdma,
    # or mooncake
    watch_interval_s: float = 0.5  # how often a waiting decode checks its prefill is alive


@dataclass(slots=True)
class Arrival:
    """What the decode side got for a room: the blocks and the prefill's report."""

    received: Received
    first_token: int
    prefill_cached: int  # prompt tokens the prefill instance did not compute
    prefill_id: int
    prefill_written_back: int = 0  # of them: from pages a decode had written back there
    prefill_pulled: int = 0  # prompt tokens the prefill pulled from a peer (not computed)


WireModel = Callable[[int], float]  # pages of one transfer -> modelled seconds (unscaled)
Allocate = Callable[[int, MemType], list[int]]  # blocks for incoming KV (count, tier)
T = TypeVar("T")


class PDLink:
    """One worker's side of disaggregation: its MemPool agent, rooms and bootstrap server.

    `allocate` gives blocks for incoming KV: the engine's allocator, which evicts its
    cache (without one, only free blocks are used). `wire`, when given (sim backend),
    models the seconds a transfer of so many real-size pages takes on the modelled
    interconnect; each push sleeps that long, times `time_scale`, after the receiver
    allocated and before the data moves.
    """

    def __init__(
        self,
        config: PDConfig,
        pool: MemPool,
        allocate: Allocate | None = None,
        wire: WireModel | None = None,
        time_scale: float = 1.0,
        on_written_back: Callable[[Received], None] | None = None,
    ) -> None:
        self.config = config
        self.on_written_back = on_written_back  # the engine learns pages a decode sent here
        self.pool = pool
        self.fake = config.transfer_backend == "fake"
        self.allocate = allocate
        self.wire = wire
        self.time_scale = time_scale
        self.agent: TransferAgent | None = None
        self.membership: ClusterManager | None = None
        self._rooms: dict[int, asyncio.Future[PeerInfo]] = {}
        self._claimed_at: dict[int, float] = {}
        self._failed: dict[int, tuple[float, str]] = {}  # prefill: rooms it could not serve
        self._waiting: dict[int, tuple[asyncio.Future[Received], int | None]] = {}
        self._bootstrap: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stats: dict[str, float] = {
            "sent": 0,
            "received": 0,
            "written_back": 0,
            "written_back_received": 0,  # write-backs a decode sent here (prefill)
            "bytes": 0,
            "failures": 0,
            "pages_moved": 0,
            "modelled_transfer_s": 0.0,
            "transfer_wall_s": 0.0,
            "late_arrivals_freed": 0,
            "waits_for_room": 0,  # pushes the decode had no room for at first
        }

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the agent (joining membership) and, on a prefill, the bootstrap server;
        TransferFailed (MembershipUnavailable...) or OSError, everything closed, when that
        cannot be done."""
        self._session = aiohttp.ClientSession()
        if self.fake:
            return
        try:
            await self._start_agent()
            if self.config.mode is PDMode.PREFILL:
                await self._start_bootstrap()
        except BaseException:
            await self.close()
            raise

    async def _start_agent(self) -> None:
        timeout = min(self.config.timeout_s, 10.0)
        agent = await start_agent(self.pool, self.config, timeout, self._on_received, self.allocate)
        self.agent = agent
        self.membership = agent.membership if self.config.cluster_redis else None
        agent.membership.on_dead(self._peer_dead)

    async def _start_bootstrap(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/route", self._route)
        app.router.add_post("/rooms/{room}", self._claim)
        app.router.add_get("/rooms/{room}", self._room_state)
        self._bootstrap = web.AppRunner(app, access_log=None)
        await self._bootstrap.setup()
        site = web.TCPSite(self._bootstrap, self.config.bootstrap_host, self.config.bootstrap_port)
        await site.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        bootstrap, agent, membership, session = (
            self._bootstrap,
            self.agent,
            self.membership,
            self._session,
        )
        self._bootstrap = self.agent = self.membership = self._session = None  # close once
        if bootstrap is not None:
            await bootstrap.cleanup()
        if agent is not None:
            await agent.close()
        if membership is not None:
            await membership.close()
        if session is not None:
            await session.close()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run PD work beside the scheduler, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _live_agent(self) -> TransferAgent:
        """The MemPool agent; TransferFailed when it is not running (fake backend, closed)."""
        if self.agent is None:
            raise TransferFailed("this instance's MemPool agent is not running")
        return self.agent

    def _http(self) -> aiohttp.ClientSession:
        """The session for bootstrap calls; TransferFailed when the link is closed."""
        if self._session is None:
            raise TransferFailed("this instance's PD link is closed")
        return self._session

    def info(self) -> dict[str, Any]:
        agent = self.agent.info if self.agent is not None else None
        stats = dict(self.stats)
        for key in ("modelled_transfer_s", "transfer_wall_s"):
            stats[key] = round(stats[key], 6)
        return {
            "disaggregation_mode": self.config.mode.value,
            "caching": self.config.caching.value,
            "transfer_backend": self.config.transfer_backend,
            "transport": None if self.agent is None else self.agent.transport.name,
            "bootstrap_port": self.config.bootstrap_port
            if self.config.mode is PDMode.PREFILL
            else None,
            "agent": None
            if agent is None
            else {"instance_id": agent.instance_id, "port": agent.port},
            "membership": self.config.cluster_redis or "in-process (peers from room claims)",
            "transfer_time": "modelled (stand-in bytes)" if self.wire else "real",
            "open_rooms": len(self._rooms),
            "claimed_rooms": sum(1 for f in self._rooms.values() if f.done()),
            "waiting_rooms": len(self._waiting),
            **stats,
        }

    # ----------------------------------------------------------------- bootstrap server

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        """This prefill instance's MemPool agent (SGLang's GET /route: where to get KV)."""
        return web.Response(body=_encode(self._live_agent().info), content_type="application/json")

    async def _claim(self, request: web.Request) -> web.Response:
        """A decode instance says where the KV of a room goes."""
        try:
            room = int(request.match_info["room"])
            peer = _peer_json.decode(await request.read())
        except (ValueError, msgspec.DecodeError) as exc:
            return json_error(400, f"bad room claim: {exc}")
        self._expire_claims()
        if room in self._failed:
            why = self._failed[room][1]
            return json_error(409, f"bootstrap_room {room} failed here: {why}")
        future = self._room(room)
        if future.done():
            return json_error(409, f"bootstrap_room {room} is already claimed")
        future.set_result(peer)
        self._claimed_at[room] = time.monotonic()
        body = b'{"room":%d,"prefill":%s}' % (room, _encode(self._live_agent().info))
        return web.Response(body=body, content_type="application/json")

    async def _room_state(self, request: web.Request) -> web.Response:
        """Where a room stands here, for a decode instance waiting for its KV: `failed`
        (with the reason) lets it answer at once instead of at its timeout."""
        try:
            room = int(request.match_info["room"])
        except ValueError as exc:
            return json_error(400, f"bad room: {exc}")
        failed = self._failed.get(room)
        future = self._rooms.get(room)
        if failed is not None:
            state = {"state": "failed", "message": failed[1]}
        elif future is not None:
            state = {"state": "claimed" if future.done() else "unclaimed"}
        else:
            state = {"state": "unknown"}  # not here yet, in flight, or done
        return web.json_response({"room": room, **state})

    def fail_room(self, room: int, why: str) -> None:
        """This prefill instance will not send `room`'s KV: a waiting decode learns why."""
        self._expire_claims()
        self._failed[room] = (time.monotonic(), why)
        if room in self._rooms and self._rooms[room].done():
            del self._rooms[room]
            self._claimed_at.pop(room, None)

    def _expire_claims(self) -> None:
        """Forget claims whose prefill request never came (the decode gave up long ago) and
        failures every decode has heard of or stopped waiting for."""
        cutoff = time.monotonic() - 2 * self.config.timeout_s
        for room in [r for r, at in self._claimed_at.items() if at < cutoff]:
            del self._claimed_at[room]
            future = self._rooms.get(room)
            if future is not None and future.done():
                del self._rooms[room]
        for room in [r for r, (at, _) in self._failed.items() if at < cutoff]:
            del self._failed[room]

    def _room(self, room: int) -> asyncio.Future[PeerInfo]:
        future = self._rooms.get(room)
        if future is None:
            future = self._rooms[room] = asyncio.get_running_loop().create_future()
        return future

    # ----------------------------------------------------------------- pushing

    async def _know(self, peer: PeerInfo) -> None:
        """Without shared membership, a peer is known from its claim (or claim answer)."""
        if self.membership is None:
            await self._live_agent().add_peer(peer)

    async def _push(
        self,
        peer_id: int,
        addrs: list[int],
        *,
        tokens: Sequence[int] | None = None,
        num_tokens: int | None = None,
        flags: TransferFlags = TransferFlags.NONE,
        private: Any = None,
    ) -> TransferResult:
        """One transfer (with insert when `tokens` are given): allocation at the receiver,
        the modelled wire time of the pages it lacks (when modelled), data, commit."""
        started = time.perf_counter()
        stream = await self._live_agent().open_stream(
            peer_id, addrs, tokens=tokens, num_tokens=num_tokens, flags=flags, private=private
        )
        async with stream:
            pages = stream.pages_total - stream.cached_pages
            if self.wire is not None:
                modelled = self.wire(pages)
                self.stats["modelled_transfer_s"] += modelled
                if modelled and self.time_scale:
                    await asyncio.sleep(modelled * self.time_scale)
            await stream.send_layers()
            result = await stream.finish()
        self.stats["transfer_wall_s"] += time.perf_counter() - started
        self.stats["pages_moved"] += pages
        self.stats["bytes"] += result.bytes
        return result

    # ----------------------------------------------------------------- prefill side

    async def send(
        self,
        room: int,
        tokens: list[int],
        addrs: list[int],
        first_token: int,
        cached_tokens: int,
        written_back_tokens: int = 0,
        pulled_tokens: int = 0,
    ) -> None:
        """Push a prefilled prompt's KV (every page, partial last page included) to the
        decode instance that claimed `room`; TransferFailed or TimeoutError if it cannot."""
        if self.fake:
            return
        future = self._room(room)
        try:
            peer = await asyncio.wait_for(future, self.config.timeout_s)
        except TimeoutError:
            self.stats["failures"] += 1
            why = (
                f"no decode instance claimed bootstrap_room {room} within "
                f"{self.config.timeout_s:g} s"
            )
            self.fail_room(room, why)
            raise TimeoutError(why) from None
        finally:
            self._rooms.pop(room, None)
            self._claimed_at.pop(room, None)
        private = {
            "room": room,
            "first_token": first_token,
            "prefill_cached": cached_tokens,
            "prefill_written_back": written_back_tokens,
            "prefill_pulled": pulled_tokens,
        }
        try:
            await self._know(peer)
            await self._push_when_room(peer, room, tokens, addrs, private)
        except TransferFailed as exc:
            self.stats["failures"] += 1
            why = (
                f"sending the KV to decode instance {peer.instance_id} "
                f"({peer.host}:{peer.port}) failed: {exc}"
            )
            self.fail_room(room, why)
            raise TransferFailed(why) from None
        self.stats["sent"] += 1

    async def _push_when_room(
        self,
        peer: PeerInfo,
        room: int,
        tokens: list[int],
        addrs: list[int],
        private: dict[str, Any],
    ) -> None:
        """Push the room's KV; while the decode has no memory for it (its running requests
        hold it all), offer it again, backing off, until the disaggregation timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        delay = 0.01
        while True:
            try:
                if self.config.caching.decode_caches:
                    await self._push(
                        peer.instance_id,
                        addrs,
                        tokens=tokens,
                        flags=TransferFlags.LOCK,
                        private=private,
                    )
                else:
                    await self._push(
                        peer.instance_id, addrs, num_tokens=len(tokens), private=private
                    )
                return
            except OutOfBlocks as exc:
                if delay == 0.01:
                    self.stats["waits_for_room"] += 1
                if loop.time() + delay > deadline:
                    raise TransferFailed(
                        f"the decode instance had no KV memory for bootstrap_room {room} "
                        f"within {self.config.timeout_s:g} s: {exc}"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)

    # ----------------------------------------------------------------- decode side

    def _on_received(self, received: Received) -> None:
        """Hand a room's KV to the request waiting for it; free KV nobody waits for any
        more (its request timed out or ended), so a late arrival cannot leak blocks."""
        private = received.private
        if not isinstance(private, dict) or "room" not in private:
            # A write-back: the index owns its pages; the engine learns them (KV events,
            # hits served from them).
            self.stats["written_back_received"] += 1
            if self.on_written_back is not None and received.inserted:
                self.on_written_back(received)
            return
        waiting = self._waiting.get(private["room"])
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(received)
            return
        log.warning(
            "KV for bootstrap_room %s arrived from instance %d after its request ended; freed",
            private["room"],
            received.peer_id,
        )
        self.stats["late_arrivals_freed"] += 1
        self.free_received(received)

    def free_received(self, received: Received) -> None:
        free_arrival(self.pool, received)

    def _peer_dead(self, instance_id: int) -> None:
        """Membership lost an instance: rooms waiting for its KV fail now."""
        for room, (future, prefill_id) in self._waiting.items():
            if prefill_id == instance_id and not future.done():
                future.set_exception(
                    TransferFailed(
                        f"the prefill instance {instance_id} left the cluster (no heartbeat) "
                        f"while bootstrap_room {room} waited for its KV"
                    )
                )

    async def _watch_prefill(self, base: str, room: int, future: asyncio.Future[Received]) -> None:
        """Fail the wait when the prefill instance says it failed the room, or when its
        bootstrap server refuses connections (its process is gone, so the KV never comes);
        a busy or slow prefill is left alone until the timeout."""
        timeout = aiohttp.ClientTimeout(total=max(self.config.watch_interval_s, 1.0))
        while not future.done():
            await asyncio.sleep(self.config.watch_interval_s)
            try:
                async with self._http().get(f"{base}/rooms/{room}", timeout=timeout) as resp:
                    state = await resp.json(content_type=None) if resp.status == 200 else {}
            except aiohttp.ClientConnectorError as exc:
                why = (
                    f"the prefill instance is gone (its bootstrap server {base} refuses "
                    f"connections: {exc.os_error}) while bootstrap_room {room} waited for its KV"
                )
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            else:
                if not isinstance(state, dict) or state.get("state") != "failed":
                    continue
                why = f"the prefill instance failed bootstrap_room {room}: {state.get('message')}"
            if not future.done():
                future.set_exception(TransferFailed(why))
            return

    async def receive(self, room: int, host: str, port: int | None) -> Arrival:
        """Claim `room` at the prefill's bootstrap server and wait for its KV."""
        if room in self._waiting:
            raise TransferFailed(f"bootstrap_room {room} is already waiting for KV here")
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self._waiting[room] = (future, None)  # before the claim: the KV may come at once
        delivered = False
        try:
            base = f"http://{host}:{port or 8998}"
            prefill = await self._claim_room(base, room)
            self._waiting[room] = (future, prefill.instance_id)
            await self._know(prefill)  # for the write-back (PD-Caching-3)
            watch = self.spawn(self._watch_prefill(base, room, future))
            try:
                received = await asyncio.wait_for(asyncio.shield(future), self.config.timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"the prefill instance sent no KV for bootstrap_room {room} within "
                    f"{self.config.timeout_s:g} s"
                ) from None
            finally:
                watch.cancel()
            delivered = True
        finally:
            self._waiting.pop(room, None)
            if not delivered and future.done() and not future.cancelled():
                if future.exception() is None:  # arrived as the wait ended: not leaked
                    self.free_received(future.result())
            elif not future.done():
                future.cancel()
        self.stats["received"] += 1
        private = received.private
        return Arrival(
            received,
            int(private["first_token"]),
            int(private["prefill_cached"]),
            prefill.instance_id,
            int(private.get("prefill_written_back") or 0),
            int(private.get("prefill_pulled") or 0),
        )

    async def _claim_room(self, base: str, room: int) -> PeerInfo:
        """POST our agent to the prefill's bootstrap server; its agent, as it answers."""
        url = f"{base}/rooms/{room}"
        try:
            async with self._http().post(
                url,
                data=_encode(self._live_agent().info),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=min(self.config.timeout_s, 10.0)),
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise TransferFailed(
                        f"prefill bootstrap {url} refused room {room}: {body.get('message')}"
                    )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TransferFailed(
                f"cannot reach the prefill bootstrap server {url}: {exc}"
            ) from None
        try:
            return msgspec.convert(body["prefill"], PeerInfo)
        except (KeyError, TypeError, msgspec.ValidationError) as exc:
            why = f"prefill bootstrap {url} answered without its agent: {exc}"
            raise TransferFailed(why) from None

    async def write_back(self, prefill_id: int, tokens: list[int], addrs: list[int]) -> None:
        """PD-Caching-3: the decode's KV goes back to the prefill instance, which inserts it
        (incremental: only the pages it lacks travel; off the request's critical path)."""
        try:
            await self._push(prefill_id, addrs, tokens=tokens)
        except TransferFailed as exc:
            self.stats["failures"] += 1
            log.warning(
                "write-back of %d tokens to instance %d failed: %s", len(tokens), prefill_id, exc
            )
            return
        self.stats["written_back"] += 1


class Bootstrap(NamedTuple):
    """A request's SGLang bootstrap fields: its room, and the prefill's bootstrap server."""

    room: int
    host: str
    port: int | None


def bootstrap_fields(extras: dict[str, Any]) -> Bootstrap | None:
    """The request's SGLang bootstrap fields, or None without them; ValueError if malformed."""
    room = extras.get("bootstrap_room")
    if room is None:
        return None
    if isinstance(room, list):
        raise ValueError("batched bootstrap_room lists are not supported; send one request each")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"'bootstrap_room' must be a non-negative integer, got {room!r}")
    host = extras.get("bootstrap_host") or "127.0.0.1"
    port = extras.get("bootstrap_port")
    if not isinstance(host, str) or (port is not None and not isinstance(port, int)):
        raise ValueError("'bootstrap_host' must be a string and 'bootstrap_port' an int or null")
    return Bootstrap(room, host, port)


class AgentSettings(Protocol):
    """Where an instance's MemPool agent listens, how it authenticates and moves bytes, and
    the shared membership it joins (None: a private table fed with peers as they appear)."""

    agent_host: str
    agent_port: int
    secret: str | None
    transport: str
    cluster_redis: str | None


async def start_agent(
    pool: MemPool,
    settings: AgentSettings,
    timeout_s: float,
    on_received: OnReceived | None,
    allocate: Allocate | None,
) -> TransferAgent:
    """This instance's MemPool agent, started and a member of `settings.cluster_redis` when
    given (`agent.membership`, closed by the caller after the agent); TransferFailed or
    OSError, nothing left open, when that cannot be done."""
    membership = None
    if settings.cluster_redis:
        membership = await redis_membership(settings.cluster_redis, pool.instance_id)
    try:
        agent = TransferAgent(
            pool,
            host=settings.agent_host,
            port=settings.agent_port,
            transport=make_transport(settings.transport, pool),
            membership=membership,
            secret=settings.secret,
            timeout_s=timeout_s,
            on_received=on_received,
            allocate=allocate,
        )
        await agent.start()  # closes itself when it fails
    except BaseException:
        if membership is not None:
            await membership.close()
        raise
    return agent


async def redis_membership(url: str, instance_id: int) -> RedisCluster:
    """Membership in Redis for this instance; TransferFailed when the store is down or
    another live member has its id (two would take each other's transfers)."""
    membership = RedisCluster(url)
    try:
        other = await membership.lookup(instance_id)
    except UnknownPeer:
        return membership
    except BaseException:
        await membership.close()
        raise
    await membership.close()
    raise TransferFailed(
        f"instance id {instance_id} is already a live member of {url} (at "
        f"{other.host}:{other.port}); give each worker its own --instance-id (a previous "
        f"run's record expires {membership.ttl_s:g} s after it stopped)"
    )


def free_arrival(pool: MemPool, received: Received) -> None:
    """Give back what an arrival holds: its lock on indexed pages, its engine blocks."""
    page = pool.spec.page_size
    whole = received.num_tokens // page if received.inserted else 0
    if received.lock is not None:
        pool.release(received.lock)
    if received.addrs[whole:]:
        pool.free_mem(received.addrs[whole:])


def make_transport(kind: str, pool: MemPool) -> str | DataTransport:
    """The data plane for this instance's agent: RDMA when asked or, with `auto`, when the
    machine has a device (MemServe's path); else TCP. TransferFailed says why a named one
    cannot run."""
    if kind == "tcp":
        return "tcp"
    if kind in ("auto", "rdma"):
        from mempool.transfer.rdma import RdmaTransport, RdmaUnavailable, rdma_devices

        try:
            devices = rdma_devices()
        except RdmaUnavailable as exc:
            if kind == "rdma":
                raise TransferFailed(f"--mempool-transport rdma: {exc}") from None
            return "tcp"
        if devices:
            return RdmaTransport(pool)
        if kind == "rdma":
            raise TransferFailed("--mempool-transport rdma: this machine has no RDMA device")
        return "tcp"
    if kind == "mooncake":
        from mempool.transfer.mooncake import MooncakeTransport, MooncakeUnavailable

        try:
            return MooncakeTransport(pool)
        except MooncakeUnavailable as exc:
            raise TransferFailed(f"--mempool-transport mooncake: {exc}") from None
    raise TransferFailed(f"unknown --mempool-transport {kind!r}: auto, tcp, rdma or mooncake")
