"""The hot-path client against real loopback servers: bodies, streams, reuse, failures."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from router.forward.upstream import UpstreamError, UpstreamPool


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _app(peers: set) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(body=b"echo:" + await request.read())

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 40_000)  # 10 MB: flow control

    async def die(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        assert request.transport is not None
        request.transport.close()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path, handler in (("/echo", echo), ("/stream", stream), ("/big", big)):
        app.router.add_post(path, handler)
    app.router.add_post("/die", die)
    app.router.add_post("/slow", slow)
    return app


def run(coro):
    return asyncio.run(coro)


def test_bodies_streams_and_connection_reuse() -> None:
    async def main() -> None:
        peers: set = set()
        runner, url = await _serve(_app(peers))
        pool = UpstreamPool()
        try:
            payload = b'{"x": "' + b"y" * 300_000 + b'"}'
            for _ in range(3):
                resp = await pool.post(url + "/echo", payload)
                assert resp.status == 200
                assert await resp.read() == b"echo:" + payload
                resp.release()
            assert len(peers) == 1  # one keep-alive connection served all three

            resp = await pool.post(url + "/stream", b"{}")
            assert resp.headers["content-type"].startswith("text/event-stream")
            chunks = [c async for c in resp.iter_chunks()]
            resp.release()
            assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(5)) + (
                b"data: [DONE]\n\n"
            )
            assert len(chunks) >= 2  # pieces arrive as written, not all at the end

            resp = await pool.post(url + "/big", b"")
            assert await resp.read() == bytes(range(256)) * 40_000
            resp.release()
        finally:
            await pool.close()
            await runner.cleanup()

    run(main())


def test_idle_connection_closed_by_the_worker_is_replaced() -> None:
    async def main() -> None:
        peers: set = set()
        runner, url = await _serve(_app(peers))
        pool = UpstreamPool()
        try:
            resp = await pool.post(url + "/echo", b"1")
            await resp.read()
            resp.release()
            for conn in list(pool._live):  # the worker drops its idle keep-alive connections
                assert conn.transport is not None
                conn.transport.close()
            await asyncio.sleep(0.05)
            resp = await pool.post(url + "/echo", b"2")
            assert await resp.read() == b"echo:2"
            resp.release()
        finally:
            await pool.close()
            await runner.cleanup()

    run(main())


def test_failures_are_upstream_errors() -> None:
    async def main() -> None:
        runner, url = await _serve(_app(set()))
        pool = UpstreamPool()
        try:
            resp = await pool.post(url + "/die", b"{}")
            with pytest.raises(UpstreamError, match="connection closed"):
                async for _ in resp.iter_chunks():
                    pass
            resp.release()
            assert not pool._idle.get(resp._conn.key)  # a broken connection is not pooled

            resp = await pool.post(url + "/slow", b"{}")  # abandoned mid-wait: not reused
            resp.release()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await pool.post(url + "/slow", b"{}")
            assert all(c.transport is None or c.transport.is_closing() for c in pool._live)
        finally:
            await pool.close()
            await runner.cleanup()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.post(url + "/echo", b"{}")
        with pytest.raises(UpstreamError, match="unsupported worker URL"):
            await pool.post("https://example.invalid/x", b"{}")

    run(main())
