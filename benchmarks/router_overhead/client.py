"""The HTTP client side: one timed chat request, worker cache flushes, and N clients
sending as fast as they can for a fixed window."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from benchmarks.router_overhead.settings import CHAT
from localrun.processes import JSON_HEADERS, Server


async def timed_chat(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[float | None, dict[str, Any] | None, str]:
    """(seconds, usage, answer text) of one chat or completion request; (None, None, "") on
    an error."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
            payload = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None, None, ""
    seconds = time.perf_counter() - t0
    if status != 200:
        return None, None, ""
    try:
        answer = json.loads(payload)
        usage = answer.get("usage")
        usage = usage if isinstance(usage, dict) else None
        choice = answer["choices"][0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    except (ValueError, AttributeError, KeyError, IndexError, TypeError):
        return seconds, None, ""
    return seconds, usage, text


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[float | None, dict[str, Any] | None]:
    """(seconds, usage) of one request; (None, None) on an error."""
    seconds, usage, _ = await timed_chat(session, url, body)
    return seconds, usage


async def flush_workers(session: aiohttp.ClientSession, workers: list[Server]) -> None:
    """Every system starts a chunk from the same (empty) worker caches."""
    for w in workers:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(w.url + "/flush_cache") as resp:
                await resp.read()


async def max_rps(
    urls: list[str],
    payloads: list[bytes],
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    cpu_s: Callable[[], float] | None = None,
) -> tuple[list[float], int, float | None]:
    """(latencies of the requests completed in the window, errors, the CPU seconds `cpu_s`
    counted over the window) from `concurrency` clients over `warmup_s` uncounted then
    `duration_s` counted seconds."""
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    counter = itertools.count()
    done: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter() + warmup_s
        end = start + duration_s

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < end:
                i = next(counter)
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        urls[i % len(urls)] + CHAT,
                        data=payloads[i % len(payloads)],
                        headers=JSON_HEADERS,
                    ) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                t1 = time.perf_counter()
                if start <= t1 <= end:  # completions inside the window
                    if ok:
                        done.append(t1 - t0)
                    else:
                        errors += 1

        async def cpu_in_window() -> float | None:
            if cpu_s is None:
                return None
            await asyncio.sleep(start - time.perf_counter())
            before = cpu_s()
            await asyncio.sleep(end - time.perf_counter())
            return cpu_s() - before

        used, *_ = await asyncio.gather(cpu_in_window(), *(client() for _ in range(concurrency)))
    return done, errors, used
