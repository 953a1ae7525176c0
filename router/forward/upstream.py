"""The router's hot-path HTTP client: keep-alive HTTP/1.1 to workers, parsed by httptools.

aiohttp's client costs about 100 us of Python per request here (request objects, URL and
header multidicts, timers, flow-control layers); a router pays it on every hop. This client
does only what forwarding needs: one POST per pooled connection at a time, the status and
headers, then the body as it arrives (Content-Length, chunked or until close, de-chunked by
httptools). Management calls (health, loads, models) keep using aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 4 * 1024 * 1024  # pause reading from a worker that runs ahead of the client
_MAX_TARGETS = 4096  # URLs whose parsed form is kept (workers x routes)


class UpstreamError(Exception):
    """The worker could not be reached, or the connection broke; `sent` = a response began."""

    def __init__(self, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reset()

    def reset(self) -> None:
        """Ready to parse the next response on this connection."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._header_name = b""
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: str | None = None
        self.received = False
        self.keep_alive = False
        self._wakeup: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP connection's transport (uvloop's does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed HTTP response: {exc}")
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.head.done() and not self._length_known():
                self.complete = True  # a body delimited by the close itself
            else:
                self._fail(f"connection closed{f': {exc}' if exc else ''}")
        self._wake()

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name:
            self._header_name = name
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        else:  # a continuation of the previous header's value
            key = self._header_name.decode("latin-1").lower()
            self.headers[key] += value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # reset once the message completes
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- helpers ---------------------------------------------------------------------------

    def _length_known(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get(
            "transfer-encoding", ""
        )

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        if not self.head.done():
            self.head.set_exception(UpstreamError(message, self.received))
        self._wake()

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_chunk(self) -> bytes | None:
        """The next piece of body, or None at its end; UpstreamError if the body broke off."""
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise UpstreamError(self.error, True)
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self._paused and self.buffered < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def send(self, *parts: bytes) -> None:
        """Write a request on this (connected) connection."""
        if self.transport is None:
            raise UpstreamError("the connection to the worker is not open")
        self.transport.writelines(parts)

    def reusable(self) -> bool:
        return (
            self.complete
            and not self.closed
            and self.keep_alive
            and not self.chunks
            and self.transport is not None
            and not self.transport.is_closing()
        )


class UpstreamResponse:
    """Status, lowercased headers and the body of one worker response."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    def release(self) -> None:
        """Back to the pool if the response was read whole, else the connection is closed."""
        if not self._released:
            self._released = True
            self._conn.pool.give_back(self._conn)


class UpstreamPool:
    """Idle keep-alive connections per (host, port); a new one whenever none is idle."""

    def __init__(self, max_idle_per_host: int = 64) -> None:
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._live: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    async def post(
        self, url: str, body: bytes, content_type: str = "application/json"
    ) -> UpstreamResponse:
        """POST `body` and wait for the status line and headers (the body streams after).

        A pooled connection the worker closed while idle is retried once on a new one:
        the worker never saw the request.
        """
        key, head = self._target(url)
        head += b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            content_type.encode("latin-1"),
            len(body),
        )
        for _attempt in range(2):
            conn, reused = await self._acquire(key)
            conn.send(head, body)
            try:
                await conn.head
            except UpstreamError as exc:
                self._discard(conn)
                if reused and not exc.started:
                    continue
                raise
            except asyncio.CancelledError:
                self._discard(conn)
                raise
            return UpstreamResponse(conn)
        raise UpstreamError(f"worker {key[0]}:{key[1]} closed the connection twice")

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the request line and fixed headers for `url`, parsed once."""
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamError(f"unsupported worker URL {url!r} (http://host:port only)")
        key = (parts.hostname, parts.port or 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept-Encoding: identity\r\n"
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
        known = self._targets[url] = (key, head.encode("latin-1"))
        return known

    async def close(self) -> None:
        for conn in list(self._live):
            self._discard(conn)
        self._idle.clear()

    def _discard(self, conn: _Connection) -> None:
        self._live.discard(conn)
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()

    async def _acquire(self, key: tuple[str, int]) -> tuple[_Connection, bool]:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reset()
                return conn, True
            self._live.discard(conn)
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self, key), *key)
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from None
        self._live.add(conn)
        return conn, False

    def give_back(self, conn: _Connection) -> None:
        """A finished response's connection: kept idle for reuse if it can be, else closed."""
        idle = self._idle.setdefault(conn.key, [])
        if conn.reusable() and len(idle) < self.max_idle_per_host:
            idle.append(conn)
        else:
            self._discard(conn)
