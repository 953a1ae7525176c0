"""The python floor: the least CPU a Python router can spend on a request (a reference row).

It parses the client's HTTP/1.1 request, sends its body to the next worker over a pooled
keep-alive connection and writes the answer back; no JSON, tokenizing, tree, metrics or
retries.

`--server` and `--client` put the HTTP libraries side by side with nothing else around them:
the hand-written httptools server, granian (RSGI, the router's server) and uvicorn (a bare
ASGI app); the router's `UpstreamPool`, aiohttp's client (tuned) and aiosonic's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import aiohttp
import aiosonic
import httptools
import uvloop

from router.forward.upstream import UpstreamError, UpstreamPool

SERVERS = ("httptools", "granian", "uvicorn")
CLIENTS = ("upstream", "aiohttp", "aiosonic")
JSON = "application/json"
UNREACHABLE = (502, b'{"error": {"message": "worker unreachable", "code": 502}}', JSON)


def _answer(status: int, body: bytes, kind: str = JSON) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


_HEALTHY = _answer(200, b"{}")
_NOT_ALLOWED = _answer(
    405, b'{"error": {"message": "the python floor forwards POST requests only", "code": 405}}'
)


class _Client(asyncio.Protocol):
    """One client connection: requests answered in order, one at a time (no pipelining)."""

    def __init__(self, proxy: FloorProxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.path = b"/"
        self.queue: asyncio.Queue[tuple[bytes, bytes, bytes] | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.task = asyncio.get_running_loop().create_task(self._answer())

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(None)

    def on_url(self, url: bytes) -> None:
        self.path = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.put_nowait((self.parser.get_method(), self.path, b"".join(self.body)))
        self.body = []

    async def _answer(self) -> None:
        while (item := await self.queue.get()) is not None:
            method, path, body = item
            if method == b"POST":
                answer = _answer(*await self.proxy.relay(path.decode("latin-1"), body))
            else:
                answer = _HEALTHY if path == b"/health" else _NOT_ALLOWED
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(answer)


class FloorProxy:
    """Round robin over the workers, bytes in and bytes out."""

    def __init__(self, worker_urls: Sequence[str], client: str = "upstream") -> None:
        self.workers = itertools.cycle([u.rstrip("/") for u in worker_urls])
        self.pool = UpstreamPool() if client == "upstream" else None
        self.session: aiohttp.ClientSession | None = None
        self.sonic: aiosonic.HTTPClient | None = None
        if client == "aiohttp":  # tuned as a gateway would: no connection cap, no decoding
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            self.session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, read_bufsize=2**16
            )
        elif client == "aiosonic":  # its default pool, as large as aiohttp's is unbounded
            pools = {":default": {"size": 256, "max_conn_requests": None}}  # keep-alive, no cap
            connector = aiosonic.TCPConnector(pool_configs=pools)
            self.sonic = aiosonic.HTTPClient(connector=connector)

    async def relay(self, path: str, body: bytes) -> tuple[int, bytes, str]:
        """The worker's status, body and content type (502 when it cannot be reached)."""
        url = next(self.workers) + path
        try:
            if self.sonic is not None:
                answer = await self.sonic.post(url, data=body, headers={"content-type": JSON})
                payload = await answer.content()
                return answer.status_code, payload, answer.headers.get("content-type") or JSON
            if self.session is not None:
                async with self.session.post(url, data=body) as resp:
                    payload = await resp.read()
                    return resp.status, payload, resp.headers.get("content-type") or JSON
            assert self.pool is not None
            response = await self.pool.post(url, body)
            payload = await response.read()
            response.release()
        except (UpstreamError, aiohttp.ClientError, OSError, aiosonic.exceptions.AiosonicError):
            return UNREACHABLE
        return response.status, payload, response.headers.get("content-type") or JSON

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.session is not None:
            await self.session.close()
        if self.sonic is not None:
            await self.sonic.aclose()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        """The floor as an RSGI app on granian (router.http_server's settings)."""
        status, payload, kind = 200, b"{}", JSON
        if scope.method == "POST":
            status, payload, kind = await self.relay(scope.path, await proto())
        proto.response_bytes(status, [("content-type", kind)], payload)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The floor as a bare ASGI app (no framework), for uvicorn with httptools."""
        if scope["type"] != "http":
            return
        status, payload, kind = 200, b"{}", JSON
        if scope["method"] == "POST":
            parts, more = [], True
            while more:
                message = await receive()
                parts.append(message.get("body", b""))
                more = message.get("more_body", False)
            status, payload, kind = await self.relay(scope["path"], b"".join(parts))
        headers = [(b"content-type", kind.encode()), (b"content-length", b"%d" % len(payload))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def serve(host: str, port: int, worker_urls: Sequence[str], server: str, client: str) -> None:
    proxy = FloorProxy(worker_urls, client)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server == "granian":
        from router.http_server import HttpServer

        rsgi = HttpServer(proxy, host, port)
        await rsgi.start()
        await stop.wait()
        await rsgi.stop()
    elif server == "uvicorn":
        import uvicorn

        config = uvicorn.Config(
            proxy,
            host=host,
            port=port,
            loop="none",
            http="httptools",
            lifespan="off",
            ws="none",
            access_log=False,
            log_config=None,
            backlog=1024,
            timeout_keep_alive=75,
        )
        # uvicorn's own serve loop: it takes SIGTERM/SIGINT over and returns on them
        await uvicorn.Server(config).serve()
    else:
        listener = await loop.create_server(lambda: _Client(proxy), host, port, backlog=1024)
        async with listener:
            await stop.wait()
    await proxy.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    parser.add_argument("--server", choices=SERVERS, default="httptools")
    parser.add_argument("--client", choices=CLIENTS, default="upstream")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.worker_urls, args.server, args.client))


if __name__ == "__main__":
    main()
