"""A round-robin front for router replicas: the load balancer of a replicated deployment, small
enough to measure.

    python -m benchmarks.multiturn.front --host 127.0.0.1 --port P --replica URL [--replica URL ...]

Each request (any path, method, headers and body) goes to the next replica in turn; the answer
comes back as the replica sends it, chunk by chunk (SSE streams are not buffered). A replica
that cannot be reached before it answered gives a 502 JSON naming it; the front does not retry
elsewhere, so a benchmark sees a failure as one. It runs as its own process (own event loop,
own CPU accounting) so that its cost is not hidden in the benchmark client's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

from localrun.processes import LOOPBACK

# Headers that describe one hop, not the message (RFC 9110 7.6.1), and those aiohttp sets
# itself from the body it sends.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
MAX_BODY_BYTES = 256 * 2**20  # a prompt of any length the benchmarks send
REPLICAS: web.AppKey[RoundRobin] = web.AppKey("replicas")
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session")


class RoundRobin:
    """The replicas' base URLs, handed out in turn."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a front needs at least one replica")
        self.urls = [u.rstrip("/") for u in urls]
        self.turn = 0
        self.sent = [0] * len(self.urls)

    def next(self) -> str:
        i = self.turn
        self.turn = (i + 1) % len(self.urls)
        self.sent[i] += 1
        return self.urls[i]


def forwarded(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The end-to-end headers, repeated ones kept."""
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]


async def proxy(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICAS].next()
    body = await request.read()
    session = request.app[SESSION]
    try:
        upstream = await session.request(
            request.method,
            replica + request.rel_url.raw_path_qs,
            headers=forwarded(request.headers),
            data=body or None,
            allow_redirects=False,
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        message = f"replica {replica} unreachable: {type(exc).__name__}: {exc}"
        error = {"message": message, "type": "bad_gateway", "code": 502, "replica": replica}
        return web.json_response({"error": error}, status=502)
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in forwarded(upstream.headers):
            response.headers.add(key, value)
        if upstream.content_length is not None and "chunked" not in (
            upstream.headers.get("Transfer-Encoding", "").lower()
        ):
            response.content_length = upstream.content_length
        await response.prepare(request)
        # A replica that dies mid-answer: the status is sent, so the stream just ends
        # (the client sees a truncated body, as it would behind any load balancer).
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        await response.write_eof()
    return response


def make_app(replicas: Sequence[str]) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[REPLICAS] = RoundRobin(replicas)

    async def client(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(client)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


async def serve(host: str, port: int, replicas: Sequence[str]) -> None:
    runner = web.AppRunner(make_app(replicas), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()  # until SIGTERM ends the process
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multiturn.front", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True, help="a replica's URL")
    args = parser.parse_args(argv)
    if args.host != LOOPBACK:
        parser.error(f"--host: the front listens on {LOOPBACK} only")
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):  # uvloop comes with the router; the front is lean
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port, args.replica))
    return 0


if __name__ == "__main__":
    sys.exit(main())
