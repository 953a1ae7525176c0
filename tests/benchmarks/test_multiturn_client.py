"""The multi-turn client against a tiny aiohttp server on loopback that refuses with 429
first: it waits the Retry-After, tries again a bounded number of times, and times TTFT and
JCT from the first try; the results count the retries."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from benchmarks.multiturn.client import (
    RETRY_429,
    Retry429,
    RunResult,
    parse_retry_after,
    run_workload,
)
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
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
        for chunk in (delta, {"choices": [{"delta": {"content": " there"}}]}, usage):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serving(handler: Refusing) -> AsyncIterator[str]:
    """The handler on a free loopback port (the kernel's pick), stopped afterwards."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler.chat)
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
    first, second = result.outcomes
    assert first.ok and second.ok, (first.error, second.error)
    assert (first.retries_429, second.retries_429) == (2, 2)
    per_request = [handler.tries["s0/2"], handler.tries["s0/4"]]
    for outcome, tries in zip(result.outcomes, per_request, strict=True):
        assert len(tries) == 3
        gaps = [b - a for a, b in itertools.pairwise(tries)]
        assert gaps[0] >= 0.2 and gaps[1] >= 0.3, gaps  # Retry-After honoured
        assert gaps[0] < 0.4 and gaps[1] < 0.5, gaps  # and not much more
        # from the first try: both waits, then the server's delay to its first token
        assert outcome.ttft_s is not None and outcome.jct_s is not None
        assert outcome.ttft_s >= 0.5 + ANSWER_DELAY_S
        assert outcome.jct_s >= outcome.ttft_s
        assert outcome.sent_s is not None
        assert abs(started + outcome.sent_s - tries[0]) < 0.1  # sent_s is the first try
    assert first.answer == "hello there" and first.completion_tokens == 2
    figures = summarize(result.outcomes, [0, 0], [7, 7], result.wall_s)
    assert figures["retries_429"] == 4 and figures["errors"] == 0
    assert figures["ttft_mean_s"] >= 0.5 + ANSWER_DELAY_S
    row = run_row({"system": "x", "available": True, **figures})
    assert row["429 retries"] == 4 and row["err"] == 0


def test_retries_are_bounded() -> None:
    handler = Refusing(refusals=100, retry_after=["0.05"])
    result, _ = run(handler, chat_workload(sessions=2), Retry429(max_retries=2))
    assert len(handler.tries["s0/2"]) == 3 and len(handler.tries["s1/2"]) == 3
    for outcome in result.outcomes:
        assert outcome.error is not None and outcome.error.startswith("HTTP 429 (after 2 retries)")
        assert outcome.retries_429 == 2 and outcome.ttft_s is None and outcome.jct_s is None
    figures = summarize(result.outcomes, [0, 0], [7, 7], result.wall_s)
    assert figures["errors"] == 2 and figures["retries_429"] == 4


def test_a_retry_after_too_long_to_wait_is_not_waited_for() -> None:
    handler = Refusing(refusals=1, retry_after=["120"])
    started = time.perf_counter()
    result, _ = run(handler, chat_workload(), Retry429(max_wait_s=60))
    assert time.perf_counter() - started < 5
    (outcome,) = result.outcomes
    assert outcome.error is not None and outcome.error.startswith("HTTP 429: ")
    assert outcome.retries_429 == 0 and len(handler.tries["s0/2"]) == 1


def test_without_retry_after_the_default_wait_is_used() -> None:
    handler = Refusing(refusals=1, retry_after=[None])
    result, _ = run(handler, chat_workload(), Retry429(default_wait_s=0.25))
    (outcome,) = result.outcomes
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
