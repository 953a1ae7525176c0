"""The router's one HTTP server: granian (Rust, hyper) through RSGI, for every route.

hyper parses HTTP/1.1 and holds the limits a gateway needs below the application: the head
of a request (request line and headers) at most `MAX_HEAD_BYTES` and 100 headers (431),
a URI under 64 KiB (414), a header-read timeout that is also the idle keep-alive timeout
(the connection is closed), and pipelined requests read only once the one before is
answered, so what a connection queues is bounded by its read buffer. Its own refusals have
empty bodies. This module answers the rest with SGLang's JSON errors: a request line or a
header over `MAX_LINE_BYTES` (431), a body over `--max-payload-size` (413, from
Content-Length before reading it, or counted as its chunks arrive), the API key (401),
unknown routes (404) and methods (405).

Handlers take an `HttpRequest` and return a `Whole`; the inference routes may answer with a
`Stream` (router.forward.reply) as the relay writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from granian._granian import RSGIHTTPStreamTransport
from granian.http import HTTP1Settings
from granian.rsgi import HTTPProtocol as RSGIHTTPProtocol
from granian.rsgi import ProtocolClosed as RSGIProtocolClosed
from granian.rsgi import ProtocolError as RSGIProtocolError
from granian.rsgi import Scope as RSGIHTTPScope
from granian.server.common import HTTPModes, Interfaces, LogLevels
from granian.server.embed import Server

from router.forward.reply import ClientSide, Stream, Whole

log = logging.getLogger(__name__)
MAX_LINE_BYTES = 8190  # a request line or one header (aiohttp's and nginx's 8 KiB)
MAX_HEAD_BYTES = 64 * 1024  # the whole head: hyper answers 431 beyond it
HEADER_READ_TIMEOUT_S = 30.0  # a head must arrive within this; also the idle keep-alive
MAX_CONNECTIONS = 16_384  # per process (granian's default would be 128, then the backlog)
# A body over the limit is still read (and dropped) up to this much and this long before the
# 413, so that the client reads the answer; larger ones are answered at once.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_S = 10.0
SHUTDOWN_GRACE_S = 60.0  # answers in flight may finish this long on shutdown (aiohttp's)
JSON = {"content-type": "application/json; charset=utf-8"}

Handler = Callable[["HttpRequest"], Awaitable[Whole]]


class RequestRefused(Exception):
    """A request refused before its handler ran; `answer` says why."""

    def __init__(self, answer: Whole) -> None:
        super().__init__(answer.status)
        self.answer = answer


class Headers(dict[str, str]):
    """A request's headers under lowercase names; `get` takes any case."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


@dataclass(slots=True)
class HttpRequest:
    """What a handler sees of a request: its route, headers and (once read) body."""

    method: str
    path: str
    query: str
    headers: Headers
    proto: RSGIHTTPProtocol
    max_body: int
    params: dict[str, str] = field(default_factory=dict)  # what a prefix route matched

    async def read(self) -> bytes:
        """The body, refused with 413 once it passes the limit (RequestRefused)."""
        declared = self.headers.get("content-length")
        try:
            if declared is not None and declared.isdigit() and int(declared) > self.max_body:
                expect = (self.headers.get("expect") or "").lower()
                if int(declared) <= DRAIN_MAX_BYTES and expect != "100-continue":
                    await self._drain(0)  # (asked to, the client sends nothing before a 100)
                raise RequestRefused(too_large(self.max_body))
            if declared is not None:
                return await self.proto()
            parts: list[bytes] = []
            size = 0
            async for chunk in self.proto:
                size += len(chunk)
                if size > self.max_body:
                    await self._drain(size)
                    raise RequestRefused(too_large(self.max_body))
                parts.append(chunk)
            return b"".join(parts)
        except (RSGIProtocolError, RSGIProtocolClosed) as exc:  # the client stopped sending
            raise RequestRefused(Whole.error(400, f"the request body ended early: {exc}")) from exc

    async def _drain(self, size: int) -> None:
        """Read what the client still sends of a refused body, discarded, up to
        DRAIN_MAX_BYTES and DRAIN_S: a client that writes its whole body before reading (most
        do) then reads the 413 instead of a broken pipe (hyper does not linger)."""

        async def discard() -> None:
            nonlocal size
            async for chunk in self.proto:
                size += len(chunk)
                if size > DRAIN_MAX_BYTES:
                    return

        with contextlib.suppress(TimeoutError, RSGIProtocolError, RSGIProtocolClosed):
            await asyncio.wait_for(discard(), DRAIN_S)


def too_large(limit: int) -> Whole:
    return Whole.error(413, f"request body larger than --max-payload-size ({limit} bytes)")


def json_reply(value: Any, status: int = 200) -> Whole:
    """`value` as a JSON answer."""
    return Whole(status, msgspec.json.encode(value), dict(JSON))


class _StreamOut(Stream):
    """A streamed answer through granian's transport (ended when the reference goes)."""

    def __init__(self, transport: RSGIHTTPStreamTransport) -> None:
        self.transport: RSGIHTTPStreamTransport | None = transport

    async def write(self, chunk: bytes) -> None:
        if self.transport is None:
            raise ConnectionResetError("the answer has ended")
        try:
            await self.transport.send_bytes(chunk)
        except RSGIProtocolClosed as exc:
            raise ConnectionResetError("the client has gone") from exc

    async def write_eof(self) -> None:
        self.transport = None  # granian ends the body when its last sender is released


class RSGIClient(ClientSide):
    """The client of one request on granian: opens its streamed answer."""

    def __init__(self, proto: RSGIHTTPProtocol, extra: list[tuple[str, str]]) -> None:
        self.proto = proto
        self.extra = extra
        self.stream: _StreamOut | None = None

    async def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        self.stream = _StreamOut(self.proto.response_stream(status, pairs(headers, self.extra)))
        return self.stream

    def close(self) -> None:
        """Release the stream's transport whatever happened (else its body never ends)."""
        if self.stream is not None:
            self.stream.transport = None


def pairs(headers: dict[str, str], extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [*headers.items(), *extra]


@dataclass(slots=True)
class Routes:
    """Handlers by path and method; `prefixes` take the rest of the path as `params[name]`."""

    exact: dict[str, dict[str, Handler]] = field(default_factory=dict)
    prefixes: list[tuple[str, str, dict[str, Handler]]] = field(default_factory=list)

    def add(self, method: str, path: str, handler: Handler) -> None:
        """`path` may end in `{name:.+}` (the rest of the path); method `*`: any."""
        if path.endswith(":.+}"):
            start = path.index("{")
            name = path[start + 1 : path.index(":", start)]
            for prefix, key, methods in self.prefixes:
                if prefix == path[:start] and key == name:
                    methods[method] = handler
                    return
            self.prefixes.append((path[:start], name, {method: handler}))
        else:
            self.exact.setdefault(path, {})[method] = handler

    def find(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler and its params; RequestRefused 404 or 405."""
        methods = self.exact.get(path)
        params: dict[str, str] = {}
        if methods is None:
            for prefix, name, candidates in self.prefixes:
                if path.startswith(prefix) and len(path) > len(prefix):
                    methods, params = candidates, {name: path[len(prefix) :]}
                    break
        if methods is None:
            raise RequestRefused(Whole.error(404, f"no route {path}"))
        handler = methods.get(method) or methods.get("*")
        if handler is None:
            allowed = ", ".join(sorted(methods))
            raise RequestRefused(
                Whole.error(405, f"{method} is not allowed on {path}", {"allow": allowed})
            )
        return handler, params


def check_head(scope: RSGIHTTPScope) -> Headers:
    """The request's headers; RequestRefused when its request line or a header is too long."""
    line = len(scope.method) + len(scope.path) + len(scope.query_string) + 11  # ' ? HTTP/1.1'
    if line > MAX_LINE_BYTES:
        message = f"request line longer than {MAX_LINE_BYTES} bytes"
        raise RequestRefused(Whole.error(400, message, {"connection": "close"}))
    headers = Headers()
    total = line
    for name, value in scope.headers.items():
        size = len(name) + len(value) + 2
        total += size + 2
        if size > MAX_LINE_BYTES:
            raise RequestRefused(
                Whole.error(
                    431,
                    f"header {name[:64]!r} longer than {MAX_LINE_BYTES} bytes",
                    {"connection": "close"},
                )
            )
        headers[name] = value
    if total > MAX_HEAD_BYTES:  # (hyper's own bound may let one read more through)
        message = f"request headers larger than {MAX_HEAD_BYTES} bytes in all"
        raise RequestRefused(Whole.error(431, message, {"connection": "close"}))
    return headers


def respond(proto: RSGIHTTPProtocol, answer: Whole, extra: list[tuple[str, str]]) -> None:
    proto.response_bytes(answer.status, pairs(answer.headers, extra), answer.body)


def port_is_free(host: str, port: int) -> bool:
    """granian binds with SO_REUSEPORT: a second router on a taken port would share it
    without a word. A bind first tells: with SO_REUSEADDR, which only a listener on the
    port refuses (not the TIME_WAIT connections a router killed a moment ago leaves)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class HttpServer:
    """One granian server in this process, on this event loop, for one RSGI app. It binds
    with SO_REUSEPORT (router processes share a port): check `port_is_free` first."""

    def __init__(
        self,
        app: object,
        host: str,
        port: int,
        header_read_timeout_s: float = HEADER_READ_TIMEOUT_S,
    ) -> None:
        self.server = Server(
            app,
            address=host,
            port=port,
            interface=Interfaces.RSGI,
            http=HTTPModes.http1,
            websockets=False,
            backlog=1024,
            backpressure=MAX_CONNECTIONS,
            runtime_threads=1,
            http1_settings=HTTP1Settings(
                header_read_timeout=max(1, int(header_read_timeout_s * 1000)),
                keep_alive=True,
                max_buffer_size=MAX_HEAD_BYTES,
                pipeline_flush=False,
            ),
            log_enabled=False,
            log_level=LogLevels.warning,
            log_access=False,
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve in the background; returns once the port accepts connections."""
        self.task = asyncio.get_running_loop().create_task(self.server.serve())
        await asyncio.sleep(0)  # the listener is bound in serve()'s first step
        if self.task.done():
            self.task.result()  # raise what stopped it

    async def stop(self) -> None:
        """Stop accepting; answers in flight finish (up to SHUTDOWN_GRACE_S)."""
        if self.task is None or self.task.done():
            return
        self.server.stop()  # type: ignore[no-untyped-call]
        try:
            await asyncio.wait_for(asyncio.shield(self.task), SHUTDOWN_GRACE_S)
        except TimeoutError:
            log.warning("answers still in flight after %.0f s: dropped", SHUTDOWN_GRACE_S)
            self.task.cancel()
