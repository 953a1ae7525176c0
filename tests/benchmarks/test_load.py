"""The load layer against tiny aiohttp servers on loopback: the sender tells broken answers
from good ones and reads both APIs' answers; a request refused with 429 waits the
Retry-After, is tried again a bounded number of times, and is timed from its first try (the
results count the retries); the bodies; the open- and closed-loop drivers."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from benchmarks.load.bodies import CHAT, COMPLETIONS, GENERATE, body
from benchmarks.load.causal import RunResult, run_workload
from benchmarks.load.closed_loop import closed_loop
from benchmarks.load.open_loop import poisson
from benchmarks.load.record import Record
from benchmarks.load.retry import RETRY_429, Retry429, parse_retry_after
from benchmarks.load.send import http_session, send
from benchmarks.multiturn.metrics import summarize
from benchmarks.multiturn.results import run_row
from benchmarks.multiturn.workloads import Request, Workload

ANSWER_DELAY_S = 0.05  # the server's time to its first token


@dataclass
class Refusing:
    """Answers each request's first `refusals` tries with 429 (these Retry-After headers, the
    last repeated), then streams an OpenAI chat answer; notes when each try came, by
    session and number of messages (one request: `s0/2` is session s0's first turn)."""

    refusals: int
    retry_after: list[str | None] = field(default_factory=lambda: ["0.2"])
    tries: dict[str, list[float]] = field(default_factory=dict)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = self.tries.setdefault(f"{body['user']}/{len(body['messages'])}", [])
        seen.append(time.perf_counter())
        if len(seen) <= self.refusals:
            header = self.retry_after[min(len(seen), len(self.retry_after)) - 1]
            error = {"object": "error", "message": "queue full", "code": 429}
            headers = {} if header is None else {"Retry-After": header}
            return web.json_response(error, status=429, headers=headers)
        await asyncio.sleep(ANSWER_DELAY_S)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"choices": [{"delta": {"content": "hello"}}]}
        last = {"choices": [{"delta": {"content": " there"}, "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
        for chunk in (delta, last, usage):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serving(handler: Refusing | Handler) -> AsyncIterator[str]:
    """The handler (a Refusing's chat) on every route, on a free loopback port (the
    kernel's pick), stopped afterwards."""
    app = web.Application()
    answer = handler.chat if isinstance(handler, Refusing) else handler
    for path in (CHAT, COMPLETIONS, GENERATE):
        app.router.add_post(path, answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def chat_workload(sessions: int = 1, turns: int = 1) -> Workload:
    requests: list[Request] = []
    for s in range(sessions):
        for t in range(turns):
            rid = len(requests)
            parent = rid - 1 if t else None
            base = [{"role": "system", "content": "be brief"}] if t == 0 else None
            requests.append(
                Request(rid, f"s{s}", t, 0.0, 2, parent=parent, base=base, user=f"q{t}")
            )
    return Workload("tiny", "tiny", requests)


def run(
    handler: Refusing, workload: Workload, retry: Retry429 = RETRY_429
) -> tuple[RunResult, float]:
    async def scenario() -> tuple[RunResult, float]:
        async with serving(handler) as url:
            started = time.perf_counter()
            result = await run_workload(url, workload, "m", timeout_s=10, retry=retry)
            return result, started

    return asyncio.run(scenario())


def test_a_refused_request_is_retried_after_retry_after_and_timed_from_its_first_try() -> None:
    handler = Refusing(refusals=2, retry_after=["0.2", "0.3"])
    result, started = run(handler, chat_workload(turns=2))
    first, second = result.records
    assert first.ok and second.ok, (first.problem, second.problem)
    assert (first.retries_429, second.retries_429) == (2, 2)
    per_request = [handler.tries["s0/2"], handler.tries["s0/4"]]
    for outcome, tries in zip(result.records, per_request, strict=True):
        assert len(tries) == 3
        gaps = [b - a for a, b in itertools.pairwise(tries)]
        assert gaps[0] >= 0.2 and gaps[1] >= 0.3, gaps  # Retry-After honoured
        assert gaps[0] < 0.7 and gaps[1] < 0.8, gaps  # and not much more (a busy machine)
        # from the first try: both waits, then the server's delay to its first token
        assert outcome.ttft_s is not None and outcome.e2e_s is not None
        assert outcome.ttft_s >= 0.5 + ANSWER_DELAY_S
        assert outcome.e2e_s >= outcome.ttft_s
        assert outcome.sent_s is not None
        assert abs(started + outcome.sent_s - tries[0]) < 0.2  # sent_s is the first try
    assert first.answer == "hello there" and first.completion_tokens == 2
    figures = summarize(result.records, [0, 0], [7, 7], result.wall_s)
    assert figures["retries_429"] == 4 and figures["errors"] == 0
    assert figures["ttft_mean_s"] >= 0.5 + ANSWER_DELAY_S
    row = run_row({"system": "x", "available": True, **figures})
    assert row["429 retries"] == 4 and row["err"] == 0


def test_retries_are_bounded() -> None:
    handler = Refusing(refusals=100, retry_after=["0.05"])
    result, _ = run(handler, chat_workload(sessions=2), Retry429(max_retries=2))
    assert len(handler.tries["s0/2"]) == 3 and len(handler.tries["s1/2"]) == 3
    for outcome in result.records:
        assert outcome.outcome == "http_429" and outcome.status == 429
        assert outcome.retries_429 == 2 and outcome.ttft_s is None and outcome.e2e_s is None
    figures = summarize(result.records, [0, 0], [7, 7], result.wall_s)
    assert figures["errors"] == 2 and figures["retries_429"] == 4


def test_a_retry_after_too_long_to_wait_is_not_waited_for() -> None:
    handler = Refusing(refusals=1, retry_after=["120"])
    started = time.perf_counter()
    result, _ = run(handler, chat_workload(), Retry429(max_wait_s=60))
    assert time.perf_counter() - started < 5
    (outcome,) = result.records
    assert outcome.problem is not None and outcome.problem.startswith("http_429: ")
    assert outcome.retries_429 == 0 and len(handler.tries["s0/2"]) == 1


def test_without_retry_after_the_default_wait_is_used() -> None:
    handler = Refusing(refusals=1, retry_after=[None])
    result, _ = run(handler, chat_workload(), Retry429(default_wait_s=0.25))
    (outcome,) = result.records
    assert outcome.ok and outcome.retries_429 == 1
    first, second = handler.tries["s0/2"]
    assert second - first >= 0.25


def later(seconds: float) -> str:
    return email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("3", 3.0),
        ("0.5", 0.5),
        ("-2", 0.0),
        (None, None),
        ("", None),
        ("soon", None),
        ("nan", None),
        (lambda: later(30), 30.0),
    ],
)
def test_retry_after_is_read_in_seconds_or_as_a_date(
    header: str | Callable[[], str] | None, seconds: float | None
) -> None:
    value = header() if callable(header) else header
    parsed = parse_retry_after(value)
    if seconds is None:
        assert parsed is None
    else:
        assert parsed == pytest.approx(seconds, abs=1.5)  # a date has whole seconds


# --------------------------------------------------------------------------- the sender


def streaming(*chunks: dict[str, Any] | bytes, done: bool = True) -> Handler:
    """A handler that streams these chunks (bytes as they are), then [DONE] if `done`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            data = chunk if isinstance(chunk, bytes) else json.dumps(chunk).encode()
            await resp.write(b"data: " + data + b"\n\n")
        if done:
            await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


def answering(payload: Any, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        if isinstance(payload, bytes):
            return web.Response(body=payload, status=status)
        return web.json_response(payload, status=status)

    return handler


def sent(handler: Handler, record: Record, need_usage: bool = False) -> Record:
    """`record` after the sender sent one body to `handler`."""

    async def go() -> None:
        async with serving(handler) as url, http_session(10) as http:
            await send(http, url, b"{}", record, need_usage=need_usage)

    asyncio.run(go())
    return record


def chat(content: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"delta": {"content": content}, "finish_reason": finish}]}


WHOLE_CHAT = {
    "choices": [{"message": {"content": "fine"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}},
}


@pytest.mark.parametrize(
    ("handler", "stream", "outcome", "status"),
    [
        (streaming(chat("hi"), done=False), True, "truncated_stream", 200),
        (streaming(chat("hi")), True, "truncated_stream", 200),  # [DONE], no finish reason
        (streaming(chat("hi"), b"{nope"), True, "malformed_event", 200),
        (streaming(chat("hi"), {"error": {"message": "boom"}}), True, "stream_error", 200),
        (streaming(chat("", "length")), True, "empty_stream", 200),
        (streaming(chat("hi", "length")), True, "ok", 200),
        (answering({"error": {"message": "boom"}}, 500), False, "http_500", 500),
        (answering({"choices": [{"message": {"content": "x"}}]}), False, "incomplete_body", 200),
        (answering(b"not json"), False, "malformed_body", 200),
        (answering(WHOLE_CHAT), False, "ok", 200),
    ],
)
def test_the_sender_tells_broken_answers_from_good_ones(
    handler: Handler, stream: bool, outcome: str, status: int
) -> None:
    record = sent(handler, Record(path=CHAT, stream=stream))
    assert record.outcome == outcome, record
    assert record.status == status
    assert record.failed == (outcome != "ok")
    if outcome == "ok":
        assert record.e2e_s is not None and record.detail is None
        assert record.answer in ("hi", "fine")
        assert (record.ttft_s is not None) == stream
    else:
        assert record.detail, record  # what came back is kept
    if record.ok and not stream:
        assert record.cached_tokens == 16 and record.prompt_tokens == 40


def test_a_bad_request_must_be_refused_with_a_json_400() -> None:
    refused = sent(answering({"error": "bad"}, 400), Record(path=CHAT, kind="bad"))
    assert refused.outcome == "bad_request_rejected" and not refused.failed
    taken = sent(answering(WHOLE_CHAT), Record(path=CHAT, kind="bad"))
    assert taken.outcome == "bad_request_got_200" and taken.failed and taken.detail
    not_json = sent(answering(b"no", 400), Record(path=CHAT, kind="bad"))
    assert not_json.outcome == "bad_request_got_400"


def test_an_abandoned_stream_is_closed_after_its_first_chunk() -> None:
    record = sent(streaming(chat("hi"), done=False), Record(path=CHAT, stream=True, kind="abandon"))
    assert record.outcome == "abandoned" and not record.failed and record.e2e_s is not None
    assert record.ttft_s is None  # not a latency sample


def test_connection_errors_and_timeouts_are_named() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response(WHOLE_CHAT)

    async def go() -> tuple[Record, Record]:
        refused, late = Record(path=CHAT), Record(path=CHAT)
        async with http_session(0.2) as http:
            await send(http, "http://127.0.0.1:9", b"{}", refused)  # the discard port: closed
            async with serving(slow) as url:
                await send(http, url, b"{}", late)
        return refused, late

    refused, late = asyncio.run(go())
    assert refused.outcome == "connection" and refused.detail
    assert late.outcome == "timeout"


META = {
    "prompt_tokens": 100,
    "completion_tokens": 2,
    "cached_tokens": 48,
    "cached_tokens_details": {"device": 32, "host": 16},
    "pulled_tokens": 32,
}


def test_the_sender_reads_both_apis() -> None:
    """SGLang's /generate chunks (cumulative text, meta_info with the split) and OpenAI's
    (deltas, usage in the last chunk); an answer without counts is an error when the
    benchmark needs them; an engine's abort is an error."""
    empty = {"text": "", "output_ids": [], "meta_info": {}}
    one = {"text": " a", "output_ids": [5], "meta_info": {}}
    last = {"text": " a b", "output_ids": [5, 6], "meta_info": {**META, "finish_reason": "x"}}
    sglang = sent(streaming(empty, one, last), Record(path=GENERATE, stream=True))
    assert sglang.ok and sglang.answer == " a b", sglang
    assert (sglang.device_tokens, sglang.host_tokens, sglang.pulled_tokens) == (32, 16, 32)
    assert (sglang.prompt_tokens, sglang.cached_tokens, sglang.completion_tokens) == (100, 48, 2)

    details = {"cached_tokens": 0, "pulled_tokens": 0}
    usage = {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": details}
    openai = streaming(chat("hi", "stop"), {"choices": [], "usage": usage})
    plain = sent(openai, Record(path=CHAT, stream=True), need_usage=True)
    assert plain.ok and plain.answer == "hi" and plain.prompt_tokens == 10
    assert (plain.device_tokens, plain.pulled_tokens) == (None, 0)  # tiers not said

    no_usage = sent(streaming(chat("hi", "stop")), Record(path=CHAT, stream=True), True)
    assert no_usage.outcome == "no_usage"

    abort = {"type": "abort", "message": "out of KV cache memory"}
    cut = {"text": " a", "output_ids": [5], "meta_info": {**META, "finish_reason": abort}}
    aborted = sent(streaming(cut), Record(path=GENERATE, stream=True))
    assert aborted.problem == "aborted: aborted by the engine: out of KV cache memory"

    whole = {"text": "a b", "meta_info": {**META, "finish_reason": {"type": "length"}}}
    generated = sent(answering(whole), Record(path=GENERATE))
    assert generated.ok and generated.answer == "a b" and generated.cached_tokens == 48


# --------------------------------------------------------------------------- bodies


def test_bodies_of_the_three_apis() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    streamed = json.loads(body(CHAT, msgs, 8, stream=True, model="m", usage=True, user="s1"))
    assert streamed == {
        "model": "m",
        "messages": msgs,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "s1",
    }
    assert json.loads(body(COMPLETIONS, "once", 4, ignore_eos=True)) == {
        "prompt": "once",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    generate = json.loads(body(GENERATE, "text", 4, stream=True, ignore_eos=True, model="m"))
    assert generate == {"text": "text", "sampling_params": sampling, "stream": True}


# --------------------------------------------------------------------------- drivers


def test_poisson_arrivals_are_seeded_and_choose_before_the_next_is_drawn() -> None:
    def arrivals(seed: int) -> list[tuple[float, float]]:
        rng = random.Random(seed)
        seen: list[tuple[float, float]] = []

        def arrive(t: float) -> Coroutine[Any, Any, None]:
            seen.append((t, rng.random()))  # a choice, drawn from the same rng

            async def nothing() -> None:
                await asyncio.sleep(0.01)

            return nothing()

        elapsed = asyncio.run(poisson(200, 0.5, rng, arrive))
        assert elapsed >= 0.5 - 0.05
        return seen

    first, again = arrivals(7), arrivals(7)
    assert 50 < len(first) < 200  # ~100 at 200/s for 0.5 s
    assert [c for _, c in first] == [c for _, c in again]
    assert all(a <= b for (a, _), (b, _) in itertools.pairwise(first))


def test_the_closed_loop_counts_what_completes_in_its_window() -> None:
    calls: list[int] = []

    async def one(i: int) -> bool:
        calls.append(i)
        await asyncio.sleep(0.01)
        return i % 10 != 0

    cpu = iter([1.0, 1.5])
    window = asyncio.run(closed_loop(one, 4, 0.1, 0.3, lambda: next(cpu)))
    assert sorted(calls) == list(range(len(calls)))  # one count across the clients
    counted = len(window.latencies) + window.errors
    assert 0.3 / 0.01 * 4 * 0.5 < counted < len(calls)  # the warm-up is not counted
    assert window.errors > 0 and all(0.01 <= s < 0.5 for s in window.latencies)
    assert window.cpu_s == 0.5
