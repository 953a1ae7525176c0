"""Prefill/decode disaggregation for the worker: SGLang's bootstrap handshake, KV by MemPool.

The router sends one request body, with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room`, to a prefill and a decode instance at once (SGLang's protocol). The decode
instance tells the prefill's bootstrap server where its MemPool agent listens (`POST
/rooms/{room}`); the prefill computes the prompt and its first token, then pushes the KV with
`transfer` or `transfer_with_insert` (MemServe figure 2), naming the room in `private`; the
decode instance picks the arrival up by room and decodes from there. Caching modes follow
MemServe table 4; PD-Caching-3 also writes the decode's KV back to the prefill instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from connector.http_errors import json_error
from connector.pd_caching import Caching
from mempool import MemPool
from mempool.transfer.agent import TransferAgent
from mempool.transfer.base import PeerInfo, TransferFailed
from mempool.transfer.receiver import Received, TransferFlags

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


@dataclass(slots=True)
class Arrival:
    """What the decode side got for a room: the blocks and the prefill's report."""

    received: Received
    first_token: int
    prefill_cached: int  # prompt tokens the prefill instance did not compute
    prefill_id: int


class PDLink:
    """One worker's side of disaggregation: its MemPool agent, rooms and bootstrap server."""

    def __init__(self, config: PDConfig, pool: MemPool) -> None:
        self.config = config
        self.pool = pool
        self.fake = config.transfer_backend == "fake"
        self.agent: TransferAgent | None = None
        self._rooms: dict[int, asyncio.Future[PeerInfo]] = {}
        self._bootstrap: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._prefills: dict[tuple[str, int], PeerInfo] = {}
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"sent": 0, "received": 0, "written_back": 0, "bytes": 0, "failures": 0}

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        if self.fake:
            return
        self.agent = TransferAgent(
            self.pool,
            host=self.config.agent_host,
            port=self.config.agent_port,
            secret=self.config.secret,
            timeout_s=min(self.config.timeout_s, 10.0),
        )
        await self.agent.start()
        if self.config.mode is PDMode.PREFILL:
            app = web.Application()
            app.router.add_get("/health", self._health)
            app.router.add_get("/route", self._route)
            app.router.add_post("/rooms/{room}", self._claim)
            self._bootstrap = web.AppRunner(app, access_log=None)
            await self._bootstrap.setup()
            site = web.TCPSite(
                self._bootstrap, self.config.bootstrap_host, self.config.bootstrap_port
            )
            await site.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._bootstrap is not None:
            await self._bootstrap.cleanup()
        if self.agent is not None:
            await self.agent.close()
        if self._session is not None:
            await self._session.close()

    def spawn(self, coro: Any) -> asyncio.Task:
        """Run PD work beside the scheduler, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def info(self) -> dict[str, Any]:
        agent = self.agent.info if self.agent is not None else None
        return {
            "disaggregation_mode": self.config.mode.value,
            "caching": self.config.caching.value,
            "transfer_backend": self.config.transfer_backend,
            "bootstrap_port": self.config.bootstrap_port
            if self.config.mode is PDMode.PREFILL
            else None,
            "agent": None
            if agent is None
            else {"instance_id": agent.instance_id, "port": agent.port},
            "open_rooms": len(self._rooms),
            **self.stats,
        }

    # ----------------------------------------------------------------- bootstrap server

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        """This prefill instance's MemPool agent (SGLang's GET /route: where to get KV)."""
        return web.Response(body=_encode(self.agent.info), content_type="application/json")

    async def _claim(self, request: web.Request) -> web.Response:
        """A decode instance says where the KV of a room goes."""
        try:
            room = int(request.match_info["room"])
            peer = _peer_json.decode(await request.read())
        except (ValueError, msgspec.DecodeError) as exc:
            return json_error(400, f"bad room claim: {exc}")
        future = self._room(room)
        if future.done():
            return json_error(409, f"bootstrap_room {room} is already claimed")
        future.set_result(peer)
        body = b'{"room":%d,"prefill":%s}' % (room, _encode(self.agent.info))
        return web.Response(body=body, content_type="application/json")

    def _room(self, room: int) -> asyncio.Future[PeerInfo]:
        future = self._rooms.get(room)
        if future is None:
            future = self._rooms[room] = asyncio.get_running_loop().create_future()
        return future

    # ----------------------------------------------------------------- prefill side

    async def send(
        self,
        room: int,
        tokens: list[int],
        addrs: list[int],
        first_token: int,
        cached_tokens: int,
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
            raise TimeoutError(
                f"no decode instance claimed bootstrap_room {room} within "
                f"{self.config.timeout_s:g} s"
            ) from None
        finally:
            self._rooms.pop(room, None)
        agent = self.agent
        await agent.add_peer(peer)
        private = {"room": room, "first_token": first_token, "prefill_cached": cached_tokens}
        try:
            if self.config.caching.decode_caches:
                result = await agent.transfer_with_insert(
                    peer.instance_id, tokens, addrs, flags=TransferFlags.LOCK, private=private
                )
            else:
                result = await agent.transfer(
                    peer.instance_id, addrs, private=private, num_tokens=len(tokens)
                )
        except TransferFailed:
            self.stats["failures"] += 1
            raise
        self.stats["sent"] += 1
        self.stats["bytes"] += result.bytes

    # ----------------------------------------------------------------- decode side

    async def receive(self, room: int, host: str, port: int | None) -> Arrival:
        """Claim `room` at the prefill's bootstrap server and wait for its KV."""
        agent = self.agent
        url = f"http://{host}:{port or 8998}/rooms/{room}"
        try:
            async with self._session.post(  # type: ignore[union-attr]
                url,
                data=_encode(agent.info),
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
            prefill = msgspec.convert(body["prefill"], PeerInfo)
        except (KeyError, TypeError, msgspec.ValidationError) as exc:
            why = f"prefill bootstrap {url} answered without its agent: {exc}"
            raise TransferFailed(why) from None
        await agent.add_peer(prefill)  # for the write-back (PD-Caching-3)
        prefill_id = prefill.instance_id

        def mine(r: Received) -> bool:
            return isinstance(r.private, dict) and r.private.get("room") == room

        try:
            received = await agent.wait_received(mine, timeout=self.config.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the prefill instance sent no KV for bootstrap_room {room} within "
                f"{self.config.timeout_s:g} s"
            ) from None
        self.stats["received"] += 1
        private = received.private
        return Arrival(
            received, int(private["first_token"]), int(private["prefill_cached"]), prefill_id
        )

    async def write_back(self, prefill_id: int, tokens: list[int], addrs: list[int]) -> None:
        """PD-Caching-3: the decode's KV goes back to the prefill instance, which inserts it
        (incremental: only the pages it lacks travel)."""
        started = time.perf_counter()
        try:
            result = await self.agent.transfer_with_insert(prefill_id, tokens, addrs)  # type: ignore[union-attr]
        except TransferFailed as exc:
            self.stats["failures"] += 1
            log.warning(
                "write-back of %d tokens to instance %d failed: %s", len(tokens), prefill_id, exc
            )
            return
        self.stats["written_back"] += 1
        self.stats["bytes"] += result.bytes
        log.debug(
            "wrote back %d pages to %d in %.1f ms",
            result.pages_sent,
            prefill_id,
            (time.perf_counter() - started) * 1e3,
        )


def bootstrap_fields(extras: dict[str, Any]) -> tuple[int, str, int | None] | None:
    """(room, host, port) from a request's SGLang bootstrap fields, or None without them."""
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
    return room, host, port
