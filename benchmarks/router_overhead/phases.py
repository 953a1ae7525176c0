"""The two measured phases over HTTP: added latency (one sequential client, systems
interleaved request by request) and maximum requests/s (N clients, slices interleaved)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import aiohttp
from rich.progress import Progress

from benchmarks.harness import children, step
from benchmarks.load.bodies import CHAT, COMPLETIONS, body
from benchmarks.load.closed_loop import Window, closed_loop
from benchmarks.load.record import Record
from benchmarks.load.send import http_session, send
from benchmarks.router_overhead.figures import p50_p99
from benchmarks.router_overhead.settings import SMALL_MAX_TOKENS, Settings
from benchmarks.router_overhead.systems import System
from benchmarks.router_overhead.text import Conversation, shared_text_prompts
from localrun.cluster import cpu_seconds
from localrun.processes import Server


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants (0 for a gone process), read
    from /proc: the router's own cost, which the client and workers sharing the box do not
    move."""
    return sum(cpu_seconds(p) for p in (pid, *children(pid)))


async def timed(session: aiohttp.ClientSession, url: str, path: str, data: bytes) -> Record:
    """One request, not streamed: its time and usage when it was answered."""
    record = Record(path=path)
    await send(session, url, data, record)
    return record


async def flush_workers(session: aiohttp.ClientSession, workers: list[Server]) -> None:
    """Every system starts a chunk from the same (empty) worker caches."""
    for w in workers:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(w.url + "/flush_cache") as resp:
                await resp.read()


async def max_rps(
    urls: list[str],
    payloads: list[bytes],
    settings: Settings,
    duration_s: float,
    cpu_s: Callable[[], float] | None,
) -> Window:
    """`settings.concurrency` clients sending chats to `urls` in turn, closed loop."""
    async with http_session(60) as session:

        async def one(i: int) -> bool:
            record = await timed(session, urls[i % len(urls)], CHAT, payloads[i % len(payloads)])
            return record.ok

        return await closed_loop(
            one, settings.concurrency, settings.rps_warmup_s, duration_s, cpu_s
        )


async def latency_phase(
    systems: list[System],
    workers: list[Server],
    small: list[bytes],
    conversations: list[Conversation],
    warmup: tuple[list[bytes], list[bytes]],
    settings: Settings,
    progress: Progress,
    model: str | None = None,
) -> None:
    """Sequential requests from one client, the systems interleaved (each request, or each
    conversation, goes through every system in turn, in a rotated order), so a change in the
    machine's speed hits every system alike and each sample pairs with the baseline's."""
    live = [s for s in systems if s.available]
    async with http_session(120) as session:
        warm = progress.add_task("warm-up", total=len(live))
        for s in live:
            for data in warmup[0] + warmup[1]:
                await timed(session, s.url, CHAT, data)
            step(progress, warm)
        small_task = progress.add_task("latency: small chat", total=len(small) * len(live))
        conv_requests = sum(len(c.turns) for c in conversations)
        conv_task = progress.add_task(
            "latency: 8K chats (cold, turns)", total=conv_requests * len(live)
        )
        for i, data in enumerate(small):  # one request per system, in a rotated order
            for s in live[i % len(live) :] + live[: i % len(live)]:
                s.record("small", await timed(session, s.url, CHAT, data))
            progress.advance(small_task, len(live))
            if i % 20 == 0:
                progress.refresh()
        for c, conv in enumerate(conversations):  # a whole conversation per system
            for s in live[c % len(live) :] + live[: c % len(live)]:
                await flush_workers(session, workers)
                messages, answer = list(conv.turns[0]), ""
                for turn in range(len(conv.turns)):
                    if turn:  # a chat client sends the answer back, then its next question
                        question = conv.turns[turn][-1]
                        reply = {"role": "assistant", "content": answer}
                        messages = [*messages, reply, question]
                    data = body(CHAT, messages, SMALL_MAX_TOKENS, model=model)
                    record = await timed(session, s.url, CHAT, data)
                    s.record("cold_8k" if turn == 0 else "multi_turn", record)
                    answer = record.answer
                progress.advance(conv_task, len(conv.turns))
            progress.refresh()
        text_task = progress.add_task(
            "latency: 8K texts, shared prefix", total=len(conversations) * len(live)
        )
        for c, conv in enumerate(conversations):  # the second of two sharing a document
            first, second = (
                body(COMPLETIONS, p, SMALL_MAX_TOKENS, model=model)
                for p in shared_text_prompts(conv)
            )
            for s in live[c % len(live) :] + live[: c % len(live)]:
                await flush_workers(session, workers)
                await timed(session, s.url, COMPLETIONS, first)
                s.record("shared_text", await timed(session, s.url, COMPLETIONS, second))
                step(progress, text_task)
        await flush_workers(session, workers)


async def rps_phase(
    systems: list[System], small: list[bytes], settings: Settings, progress: Progress
) -> None:
    """Each system's window is cut into slices run in a rotated order across systems, so a
    change in the machine's speed during the phase hits every system alike."""
    live = [s for s in systems if s.available]
    slices = settings.rps_slices
    per_slice = settings.rps_duration_s / slices
    task = progress.add_task(
        f"max rps ({settings.concurrency} clients, {settings.rps_duration_s:g} s each)",
        total=len(live) * slices,
    )
    latencies: dict[str, list[float]] = {s.name: [] for s in live}
    errors = dict.fromkeys(latencies, 0)
    per: dict[str, list[float]] = {s.name: [] for s in live}
    cpu: dict[str, float | None] = dict.fromkeys(latencies, 0.0)
    for k in range(slices):
        for s in live[k % len(live) :] + live[: k % len(live)]:
            server = s.server
            probe = functools.partial(tree_cpu_s, server.proc.pid) if server else None
            window = await max_rps(s.rps_urls, small, settings, per_slice, probe)
            latencies[s.name] += window.latencies
            errors[s.name] += window.errors
            per[s.name].append(len(window.latencies) / per_slice)
            so_far, used = cpu[s.name], window.cpu_s
            cpu[s.name] = None if used is None or so_far is None else so_far + used
            step(progress, task)
    for s in live:
        done = latencies[s.name]
        used = cpu[s.name]
        s.rps = {
            "rps": len(done) / settings.rps_duration_s,
            "requests": len(done),
            "errors": errors[s.name],
            "concurrency": settings.concurrency,
            "duration_s": settings.rps_duration_s,
            "slices_rps": per[s.name],
            "latency_ms": p50_p99(done, 1e3),
            # the router's own CPU (its processes) in the counted windows, per completion
            "router_cpu_s": used,
            "router_cpu_us_per_request": used / len(done) * 1e6 if used and done else None,
        }
