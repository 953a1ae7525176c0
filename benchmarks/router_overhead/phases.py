"""The measured phases: added latency (one sequential client, systems interleaved request by
request) and maximum requests/s (N clients, slices interleaved) over HTTP, then in process
what our router's tokenizer and routing decision cost on an 8K-token chat."""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

import aiohttp
from rich.progress import Progress

from benchmarks.harness import children, step
from benchmarks.load.bodies import CHAT, COMPLETIONS, body
from benchmarks.load.closed_loop import Window, closed_loop
from benchmarks.load.record import Record
from benchmarks.load.send import http_session, send
from benchmarks.router_overhead.figures import p50_p99
from benchmarks.router_overhead.settings import (
    SMALL_MAX_TOKENS,
    Conversation,
    Settings,
    make_conversation,
    shared_text_prompts,
)
from benchmarks.router_overhead.systems import System
from localrun.cluster import cpu_seconds
from localrun.processes import Server


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants (0 once gone), from /proc: the
    router's own cost, which the client and workers sharing the box do not move."""
    return sum(cpu_seconds(p) for p in (pid, *children(pid)))


async def timed(session: aiohttp.ClientSession, url: str, path: str, data: bytes) -> Record:
    """One request, not streamed: its time and usage when it was answered."""
    record = Record(path=path)
    await send(session, url, data, record)
    return record


def rotated(live: list[System], i: int) -> list[System]:
    """The systems from the i-th on: no system always goes first."""
    k = i % len(live)
    return live[k:] + live[:k]


def shuffled(live: list[System], i: int) -> list[System]:
    """The systems in an order drawn for the i-th request (seeded by i): no system always
    goes first, nor always after the same one. In a rotation the system after `direct`
    met the workers as `direct` left them every time, and its cold 8K chats came out about
    1 ms slower than the same router's one place further on (measured both ways round)."""
    return random.Random(i).sample(live, len(live))


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
    warmup: list[bytes],
    progress: Progress,
    model: str | None = None,
) -> None:
    """Sequential requests from one client, each request (or conversation) through every
    system in a shuffled order: a change in the machine's speed hits every system alike, and
    each sample pairs with the baseline's."""
    live = [s for s in systems if s.available]
    async with http_session(120) as session:
        warm = progress.add_task("warm-up", total=len(live))
        for s in live:
            for data in warmup:
                await timed(session, s.url, CHAT, data)
            step(progress, warm)
        small_task = progress.add_task("latency: small chat", total=len(small) * len(live))
        conv_requests = sum(len(c.turns) for c in conversations)
        conv_task = progress.add_task(
            "latency: 8K chats (cold, turns)", total=conv_requests * len(live)
        )
        for i, data in enumerate(small):
            for s in shuffled(live, i):
                s.record("small", await timed(session, s.url, CHAT, data))
            progress.advance(small_task, len(live))
            if i % 20 == 0:
                progress.refresh()
        for c, conv in enumerate(conversations):  # a whole conversation per system
            for s in shuffled(live, c):
                await flush_workers(session, workers)
                messages, answer = list(conv.turns[0]), ""
                for turn in range(len(conv.turns)):
                    if turn:  # a chat client sends the answer back, then its next question
                        reply = {"role": "assistant", "content": answer}
                        messages = [*messages, reply, conv.turns[turn][-1]]
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
            for s in shuffled(live, c):
                await flush_workers(session, workers)
                await timed(session, s.url, COMPLETIONS, first)
                s.record("shared_text", await timed(session, s.url, COMPLETIONS, second))
                step(progress, text_task)
        await flush_workers(session, workers)


async def rps_phase(
    systems: list[System], small: list[bytes], settings: Settings, progress: Progress
) -> None:
    """Each system's window cut into slices run in a rotated order across systems: a change
    in the machine's speed during the phase hits every system alike."""
    live = [s for s in systems if s.available]
    slices, duration = settings.rps_slices, settings.rps_duration_s
    task = progress.add_task(
        f"max rps ({settings.concurrency} clients, {duration:g} s each)", total=len(live) * slices
    )
    windows: dict[str, list[Window]] = {s.name: [] for s in live}
    for k in range(slices):
        for s in rotated(live, k):
            probe = functools.partial(tree_cpu_s, s.server.proc.pid) if s.server else None
            windows[s.name].append(
                await max_rps(s.rps_urls, small, settings, duration / slices, probe)
            )
            step(progress, task)
    for s in live:
        done = [x for w in windows[s.name] for x in w.latencies]
        cpu = [w.cpu_s for w in windows[s.name]]
        # the router's own CPU (its processes) in the counted windows, per completion
        used = None if None in cpu else sum(c for c in cpu if c is not None)
        s.rps = {
            "rps": len(done) / duration,
            "requests": len(done),
            "errors": sum(w.errors for w in windows[s.name]),
            "concurrency": settings.concurrency,
            "duration_s": duration,
            "slices_rps": [len(w.latencies) / (duration / slices) for w in windows[s.name]],
            "latency_ms": p50_p99(done, 1e3),
            "router_cpu_s": used,
            "router_cpu_us_per_request": used / len(done) * 1e6 if used and done else None,
        }


def tokenizer_costs(
    tokenizer: Any, conversations: list[Conversation], progress: Progress
) -> dict[str, Any]:
    """Full encode of an 8K chat (what an engine does), and the router's own encode of a new
    chat (cold) and of its second turn (warm), as the router runs its CachedEncoder: on its
    encode thread, the cached part first (`encode_chat_known`), then the new text."""
    from shared.token_cache import CachedEncoder

    task = progress.add_task("tokenizer: 8K chats", total=len(conversations) - 1)
    encoder = CachedEncoder(tokenizer)
    encoder.start_thread()
    encoder.encode_chat(conversations[0].turns[0])  # a running router knows the system prompt

    def routed(messages: list[dict[str, str]]) -> array:
        known = encoder.encode_chat_known(messages)
        return encoder.complete(known.ids, known.rest)

    times: dict[str, list[float]] = {}

    def timed_call(kind: str, call: Callable[[Any], Any], arg: Any) -> Any:
        t0 = time.perf_counter()
        result = call(arg)
        times.setdefault(kind, []).append(time.perf_counter() - t0)
        return result

    try:
        for conv in conversations[1:]:
            timed_call("full_encode_ms", tokenizer.encode_chat, conv.turns[0])
            timed_call("render_ms", tokenizer.render_chat, conv.turns[0])
            ids = timed_call("cached_cold_ms", routed, conv.turns[0])
            timed_call("cached_warm_ms", routed, conv.turns[1])
            if len(ids) != conv.tokens:
                raise RuntimeError(f"the router's encode gave {len(ids)} ids, not {conv.tokens}")
            step(progress, task)
    finally:
        encoder.close()
    return {k: p50_p99(v, 1e3) for k, v in times.items()} | {
        "conversations": len(conversations) - 1,
        "tokens_p50": statistics.median(c.tokens for c in conversations[1:]),
    }


def decision_time(tokenizer: Any, settings: Settings, progress: Progress) -> dict[str, Any]:
    """PromptTree.select for an 8K-token request over trees holding many 8K chats."""
    from router.policies import CostModel, PromptTree, RouteRequest, Thresholds
    from router.trees import PromptTrees
    from router.workers import Worker, WorkerType
    from shared.token_cache import CachedEncoder

    n = settings.tree_conversations
    build = progress.add_task(f"decision: {n} chats into trees", total=n + 1)
    encoder = CachedEncoder(tokenizer)
    workers = [Worker(f"http://10.0.0.{i + 1}:30000") for i in range(settings.tree_workers)]
    trees = PromptTrees(page_size=16)
    policy = PromptTree(trees, Thresholds(), CostModel())
    kind = WorkerType.COLOCATED
    hits: list[list[int]] = []
    for i in range(n):
        conv = make_conversation(tokenizer, 10_000 + i, turns=2, exact=False)
        first = encoder.encode_chat(conv.turns[0])
        generated = tokenizer.encode(conv.turns[1][-2]["content"], add_special_tokens=False)
        trees.record(kind, workers[i % len(workers)].url, first + generated)  # after turn 1
        hits.append(encoder.encode_chat(conv.turns[1]))  # turn 2: a long prefix is held
        step(progress, build)
    misses = [  # new chats: only the shared system prompt is held
        encoder.encode_chat(make_conversation(tokenizer, 20_000 + i, 1, exact=False).turns[0])
        for i in range(min(n, 20))
    ]
    step(progress, build)

    calls = settings.decision_calls
    timing = progress.add_task("decision: select() and record()", total=4)
    results: dict[str, Any] = {}
    # select() is timed on the uint32 array the router's token cache assembles; the list
    # variant (an engine passing Python lists) shows what the conversion alone would cost.
    arrays = [array("I", t) for t in hits]
    for case, requests in (("hit", arrays), ("miss", [array("I", t) for t in misses])):
        samples = []
        reasons: dict[str, int] = {}
        for k in range(calls):
            request = RouteRequest(requests[k % len(requests)], "", None)
            t0 = time.perf_counter_ns()
            decision = policy.select(request, workers)
            samples.append(time.perf_counter_ns() - t0)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        results[f"select_{case}_us"] = p50_p99(samples, 1e-3)
        results[f"select_{case}_reasons"] = reasons
        step(progress, timing)
    to_array, to_list, with_list, records = [], [], [], []
    for k in range(calls):
        tokens, ids = hits[k % len(hits)], arrays[k % len(hits)]
        t0 = time.perf_counter_ns()
        array("I", tokens)
        t1 = time.perf_counter_ns()
        ids.tolist()
        t2 = time.perf_counter_ns()
        policy.select(RouteRequest(tokens, "", None), workers)
        t3 = time.perf_counter_ns()
        to_array.append(t1 - t0)
        to_list.append(t2 - t1)
        with_list.append(t3 - t2)
    step(progress, timing)
    for k in range(calls):  # the router's optimistic record on dispatch: mostly held already
        i = k % len(hits)
        t0 = time.perf_counter_ns()
        trees.record(kind, workers[i % len(workers)].url, arrays[i])
        records.append(time.perf_counter_ns() - t0)
    step(progress, timing)
    return results | {
        "list_to_uint32_us": p50_p99(to_array, 1e-3),
        "uint32_to_list_us": p50_p99(to_list, 1e-3),
        "select_hit_list_us": p50_p99(with_list, 1e-3),
        "record_8k_us": p50_p99(records, 1e-3),
        "request_tokens_p50": statistics.median(len(t) for t in hits),
        "tree_conversations": n,
        "tree_workers": len(workers),
        "tree_pages": trees.size(kind),
        "calls": calls,
    }
