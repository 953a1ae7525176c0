"""The inference routes' HTTP/1.1 server: httptools in front of aiohttp.

aiohttp's server spent about a quarter of the router's CPU a request (its parser, request and
response objects, middlewares and writer; docs/benchmarks/router-overhead.md). The three
inference routes (POST /generate, /v1/chat/completions, /v1/completions) are served here,
parsed by httptools and answered straight onto the socket. Any other request hands its
connection, with the bytes read so far, to aiohttp's server for the rest of the connection's
life: management, metrics and unknown routes behave exactly as before, and so does an
inference request that arrives on a connection aiohttp already holds.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, cast

import httptools

from router.admission import Refused
from router.reply import ClientSide, Stream, Whole
from router.request import INFERENCE_ROUTES, RequestError
from router.server import UNAUTHORIZED

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger(__name__)
FAST_ROUTES = {route.encode(): route for route in INFERENCE_ROUTES}
IDLE_TIMEOUT_S = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default)
SWEEP_S = 15.0
SHUTDOWN_GRACE_S = 60.0  # answers in flight may finish this long on shutdown (aiohttp's)
LINGER_S = 10.0  # after a refusal mid-request, what the client still sends is read this long
PIPELINED = "a request for another route pipelined behind an inference request on one "
PIPELINED += "connection: send it after the answer, or on another connection"


class Headers(dict[str, str]):
    """A request's headers under lowercase names; `get` takes any case."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


class _Exchange(ClientSide, Stream):
    """One request on a fast connection and its answer (whole, or streamed)."""

    def __init__(
        self,
        conn: FastConnection,
        route: str,
        headers: Headers,
        body: bytes,
        keep_alive: bool,
        http11: bool,
        refused: Whole | None = None,
    ) -> None:
        self.conn = conn
        self.route = route
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive and http11  # a stream to HTTP/1.0 ends with the close
        self.chunked = http11
        self.refused = refused
        self.started = False  # the status line is out
        self.done = False  # the whole answer is out

    async def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        if self.chunked:
            headers = {**headers, "transfer-encoding": "chunked"}
        self.conn.send(self, self.conn.head(status, headers, self))
        return self

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        conn = self.conn
        conn.send(self, b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        if conn.writing_paused:
            await conn.drained()

    async def write_eof(self) -> None:
        if not self.done:
            self.conn.finish(self, b"0\r\n\r\n" if self.chunked else b"")

    def write_whole(self, answer: Whole) -> None:
        headers = {**answer.headers, "content-length": str(len(answer.body))}
        self.conn.finish(self, self.conn.head(answer.status, headers, self) + answer.body)


class FastConnection(asyncio.Protocol):
    """One client connection: requests parsed by httptools, answered in order."""

    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.raw: list[bytes] = []  # the bytes since the current message's chunk began
        self.keep_raw = False  # until its route is known: the bytes aiohttp would need
        self.in_message = False
        self.fresh = False  # the chunk being parsed began between two messages
        self.clean = False  # the current message began at the start of a chunk
        self.url = b""
        self.headers = Headers()
        self.body: list[bytes] = []
        self.size = 0
        self.route = ""
        self.refused: Whole | None = None
        self.switch = False  # hand the connection to aiohttp (set in a parser callback)
        self.stopped = False  # read nothing more: the connection closes after its answers
        self.current: _Exchange | None = None
        self.queue: collections.deque[_Exchange] = collections.deque()
        self.writing_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.last_active = time.monotonic()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self._wake_writer()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.stopped:
            return
        if not self.in_message:
            self.raw = [data]
            self.fresh = True
        elif self.keep_raw:
            self.raw.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # (offers to upgrade go to aiohttp first)
            self._refuse(Whole.error(400, "an upgrade to another protocol is not supported"))
        except httptools.HttpParserError as exc:
            if self.switch:
                self._hand_over()
            elif not self.stopped:  # (stopped: a refusal already queued)
                self._refuse(Whole.error(400, f"malformed HTTP request: {exc}"))

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_message = True
        self.keep_raw = True
        self.clean = self.fresh
        self.url = b""
        self.headers = Headers()
        self.body = []
        self.size = 0
        self.refused = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        route = None
        if self.parser.get_method() == b"POST" and not self._upgrade_asked():
            route = FAST_ROUTES.get(self.url.partition(b"?")[0])
        if route is None:
            self.switch = True
            raise _Stop  # aborts the parse: aiohttp's server takes it from here
        self.route = route
        self.keep_raw = False
        self.raw = []
        router = self.server.router
        if not router.authorized(route, self.headers.get("authorization") or ""):
            self.refused = Whole.error(401, UNAUTHORIZED)
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            self._refuse(Whole.error(413, router.too_large()))
            raise _Stop
        expect = (self.headers.get("expect") or "").lower()
        if expect == "100-continue" and self.refused is None and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _upgrade_asked(self) -> bool:
        """An offer to switch protocols (curl --http2's h2c): httptools would stop at the
        headers, so the request goes to aiohttp's server, which declines it."""
        connection = (self.headers.get("connection") or "").lower()
        return "upgrade" in self.headers and "upgrade" in connection

    def on_body(self, body: bytes) -> None:
        if self.refused is not None:
            return  # read and dropped: the connection stays usable
        self.size += len(body)
        if self.size > self.server.max_body:
            self._refuse(Whole.error(413, self.server.router.too_large()))
            raise _Stop
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        self.fresh = False
        parser = self.parser
        exchange = _Exchange(
            self,
            self.route,
            self.headers,
            b"".join(self.body),
            parser.should_keep_alive(),
            parser.get_http_version() == "1.1",
            self.refused,
        )
        self.body = []
        self._enqueue(exchange)

    # -- answering -------------------------------------------------------------------------

    def _enqueue(self, exchange: _Exchange) -> None:
        if self.current is None:
            self._start(exchange)
        else:
            self.queue.append(exchange)

    def _start(self, exchange: _Exchange) -> None:
        self.current = exchange
        if exchange.refused is not None:
            exchange.write_whole(exchange.refused)
        else:
            task = asyncio.get_running_loop().create_task(self._answer(exchange))
            self.server.tasks.add(task)
            task.add_done_callback(self.server.tasks.discard)

    async def _answer(self, exchange: _Exchange) -> None:
        router = self.server.router
        try:
            result = await router.serve_inference(
                exchange.route, exchange.headers, exchange.body, exchange
            )
        except RequestError as exc:
            result = Whole.error(exc.status, str(exc), exc.headers)
        except Refused as exc:
            result = Whole.error(429, str(exc), {"retry-after": str(exc.retry_after_s)})
        except ConnectionResetError:
            self.close()
            return
        except Exception:
            log.exception("error while answering %s", exchange.route)
            result = Whole.error(500, "internal router error (see the router's log)")
        if exchange.done:
            return
        if isinstance(result, Whole) and not exchange.started:
            exchange.write_whole(result)
        else:  # a stream that neither finished nor could take an error: the close ends it
            exchange.keep_alive = False
            self.finish(exchange, b"")

    def head(self, status: int, headers: dict[str, str], exchange: _Exchange) -> bytes:
        """The status line and headers of an answer to `exchange`."""
        lines = [self.server.status_line(status)]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        lines.append(self.server.fixed_headers())
        if not exchange.keep_alive:
            lines.append("connection: close\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def send(self, exchange: _Exchange, data: bytes) -> None:
        """Part of `exchange`'s answer; ConnectionResetError once the client has gone."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        exchange.started = True
        self.transport.write(data)

    def finish(self, exchange: _Exchange, data: bytes) -> None:
        """The last bytes of `exchange`'s answer; the next queued request starts."""
        exchange.done = True
        if self.transport is not None and not self.transport.is_closing():
            exchange.started = True
            if data:
                self.transport.write(data)
        self.current = None
        if not exchange.keep_alive and self.stopped:
            self._linger()
        elif not exchange.keep_alive:
            self.close()
        elif self.queue:
            self._start(self.queue.popleft())

    async def drained(self) -> None:
        """Wait until the client has read enough of what was written."""
        while self.writing_paused:
            if self.transport is None:
                raise ConnectionResetError("the client closed the connection")
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _refuse(self, answer: Whole) -> None:
        """Answer `answer` after what is queued, then close: nothing more is read."""
        self.stopped = True
        self.in_message = False
        exchange = _Exchange(self, self.route, self.headers, b"", False, True, answer)
        self._enqueue(exchange)

    def _hand_over(self) -> None:
        """A request for another route: the connection becomes aiohttp's, bytes included."""
        if not self.clean or self.current is not None or self.queue:
            self._refuse(Whole.error(400, PIPELINED))
            return
        transport = self.transport
        if transport is None:
            return
        self.stopped = True
        self.transport = None  # aiohttp's from now on
        self.server.connections.discard(self)
        handler = self.server.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(b"".join(self.raw))
        self.raw = []

    def _linger(self) -> None:
        """After a refusal mid-request (413, malformed): the answer is out, so send FIN and
        read and drop what the client still sends until it closes or LINGER_S pass. Closing
        with its body unread would reset the connection and could lose the answer (aiohttp
        lingers the same way)."""
        transport = self.transport
        if transport is None:
            return
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def idle_for(self, now: float) -> float:
        """How long the connection has had nothing to answer and nothing arrived."""
        if self.current is not None or self.queue:
            return 0.0
        return now - self.last_active


class _Stop(Exception):
    """Raised in a parser callback to stop parsing the connection's bytes."""


class FastServer:
    """The protocol factory: the router's inference routes, aiohttp's server behind."""

    def __init__(
        self,
        router: Router,
        fallback: Callable[[], asyncio.Protocol],
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        self.router = router
        self.fallback = fallback  # a new aiohttp RequestHandler for a handed-over connection
        self.max_body = router.config.max_payload_bytes
        self.connections: set[FastConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (extra_headers or {}).items())
        self._date_second = -1
        self._fixed = ""
        self._status_lines: dict[int, str] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._listener: asyncio.Server | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        """Listen on host:port (SO_REUSEPORT for a router of several processes)."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self, host, port, reuse_port=reuse_port, backlog=1024
        )

    def __call__(self) -> FastConnection:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return FastConnection(self)

    def status_line(self, status: int) -> str:
        line = self._status_lines.get(status)
        if line is None:
            try:
                reason = HTTPStatus(status).phrase
            except ValueError:
                reason = "Unknown"
            line = self._status_lines[status] = f"HTTP/1.1 {status} {reason}\r\n"
        return line

    def fixed_headers(self) -> str:
        """`date` (computed once a second) and the process header, when there is one."""
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            date = email.utils.formatdate(now, usegmt=True)
            self._fixed = f"date: {date}\r\nserver: memserve-router\r\n{self._extra}"
        return self._fixed

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.idle_for(now) > IDLE_TIMEOUT_S:
                    conn.close()

    async def close(self) -> None:
        """Idle connections closed now; answers in flight finish first (up to a limit)."""
        if self._listener is not None:
            self._listener.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.current is None and not conn.queue:
                conn.close()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=SHUTDOWN_GRACE_S)
        for conn in list(self.connections):
            conn.close()
