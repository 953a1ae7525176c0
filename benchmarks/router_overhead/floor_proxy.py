"""`python -m benchmarks.router_overhead.floor_proxy --port P --worker-urls URL [URL ...]`:
the least CPU a Python router can spend on a request, as a reference row.

It does only what every router must: parse the client's HTTP/1.1 request (httptools), send
its body to the next worker in turn over a pooled keep-alive connection (the router's own
`UpstreamPool`) and write the worker's answer back. No JSON, no tokenizing, no tree, no
metrics, no retries. Whatever a Python router does beyond this costs more. Where this row
spends more CPU a request than a Rust router, no Python router can match that router on the
same cores; where it spends less, the difference between ours and this row is ours to cut.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import Sequence
from http import HTTPStatus

import httptools
import uvloop

from router.upstream import UpstreamError, UpstreamPool


def _answer(status: int, body: bytes, kind: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _error(status: int, message: str) -> bytes:
    return _answer(status, b'{"error": {"message": "%s", "code": %d}}' % (message.encode(), status))


_HEALTHY = _answer(200, b"{}")
_BAD_GATEWAY = _error(502, "worker unreachable")
_NOT_ALLOWED = _error(405, "the python floor forwards POST requests only")


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
                answer = await self.proxy.forward(path, body)
            else:
                answer = _HEALTHY if path == b"/health" else _NOT_ALLOWED
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(answer)


class FloorProxy:
    """Round robin over the workers, bytes in and bytes out."""

    def __init__(self, worker_urls: Sequence[str]) -> None:
        self.workers = itertools.cycle([u.rstrip("/") for u in worker_urls])
        self.pool = UpstreamPool()

    async def forward(self, path: bytes, body: bytes) -> bytes:
        try:
            response = await self.pool.post(next(self.workers) + path.decode("latin-1"), body)
            payload = await response.read()
            response.release()
        except UpstreamError:
            return _BAD_GATEWAY
        return _answer(
            response.status, payload, response.headers.get("content-type", "application/json")
        )


async def serve(host: str, port: int, worker_urls: Sequence[str]) -> None:
    proxy = FloorProxy(worker_urls)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(proxy), host, port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    await proxy.pool.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.worker_urls))


if __name__ == "__main__":
    main()
