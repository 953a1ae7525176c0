"""Admission limits in-process (the token bucket, the queue) and over HTTP (429s), and
admission by expected wait end to end: OpenAI SDK clients retrying the router's 429s."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from router.admission import Admission, Limits, Refused, TokenBucket
from tests.http_client import call
from tests.procs import ROOT, running


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=2.0, clock=clock)
    assert bucket.take() == 0.0 and bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.5)  # empty: a token in half a second
    clock.now += 0.5
    assert bucket.take() == 0.0
    clock.now += 100  # idle for long: still only the burst
    assert bucket.available() == 2.0


def test_rate_limited_requests_wait_their_turn_or_are_refused() -> None:
    async def scenario() -> tuple[int, int, float]:
        admission = Admission(Limits(rate_per_s=20.0, queue_size=3, queue_timeout_s=5))
        admitted = refused = 0
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def one() -> None:
            nonlocal admitted, refused
            try:
                async with admission.slot():
                    admitted += 1
            except Refused:
                refused += 1

        await asyncio.gather(*(one() for _ in range(30)))
        return admitted, refused, loop.time() - started

    admitted, refused, took = asyncio.run(scenario())
    # a burst of 20, then at most 3 waiting for the refill; the rest refused at once
    assert admitted == 23 and refused == 7
    assert 0.1 <= took < 2


def test_a_wait_longer_than_the_queue_timeout_is_refused() -> None:
    async def scenario() -> str:
        admission = Admission(Limits(max_concurrent=1, queue_timeout_s=0.2))
        async with admission.slot():
            try:
                async with admission.slot():
                    return "admitted"
            except Refused as exc:
                return str(exc)

    assert "timed out" in asyncio.run(scenario())


def test_the_router_is_short_of_slots_only_while_a_request_waits_for_one() -> None:
    async def scenario() -> list[bool]:
        admission = Admission(Limits(max_concurrent=1))
        seen = [admission.short_of_slots()]
        release = asyncio.Event()

        async def holder() -> None:
            async with admission.slot():
                seen.append(admission.short_of_slots())  # the only slot taken, no one waits
                await release.wait()

        async def waiter() -> None:
            async with admission.slot():
                seen.append(admission.short_of_slots())  # in: nothing waits any more

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        second = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        seen.append(admission.short_of_slots())
        release.set()
        await asyncio.gather(first, second)
        unlimited = Admission(Limits(rate_per_s=1000.0))
        async with unlimited.slot():
            seen.append(unlimited.short_of_slots())
        return seen

    assert asyncio.run(scenario()) == [False, False, True, False, False]


def test_over_the_rate_is_429_with_retry_after(model_dir: Path, tmp_path: Path) -> None:
    worker_args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    with running("connector.worker", worker_args, tmp_path) as w:
        args = ["--policy", "round_robin", "--worker-urls", w.url]
        args += ["--rate-limit-tokens-per-second", "2", "--queue-size", "0"]
        with running("router", args, tmp_path) as r:
            codes = []
            for i in range(6):
                req = urllib.request.Request(
                    r.url + "/generate",
                    json.dumps(
                        {"text": f"hi {i}", "sampling_params": {"max_new_tokens": 1}}
                    ).encode(),
                    {"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=10) as resp:
                        codes.append(resp.status)
                except urllib.error.HTTPError as err:
                    codes.append(err.code)
                    assert err.headers["Retry-After"] == "1"
                    assert "queue" in json.loads(err.read())["message"]
            assert codes.count(200) >= 2 and 429 in codes


@pytest.mark.parametrize(
    "flag", [("--max-concurrent-requests", "-1"), ("--queue-timeout-secs", "0")]
)
def test_nonsense_limits_are_a_one_line_start_error(flag: tuple[str, str]) -> None:
    from router.__main__ import build_parser, check_limits

    args = build_parser().parse_args(list(flag))
    with pytest.raises(SystemExit, match=flag[0]):
        check_limits(args)


# Admission by expected wait, end to end: a sim worker whose prefills take real time (its
# H100 model slowed 20x), the router's cost model slowed to match, a deadline of 0.3 s.
TIME_SCALE = 20
WAIT_ROUTER_ARGS = [
    "--max-expected-wait-secs",
    "0.3",
    "--queue-size",
    "3",
    "--queue-timeout-secs",
    "10",
    "--prefill-secs-per-token",
    str(4e-5 * TIME_SCALE),
    "--busy-secs-per-request",
    str(2e-3 * TIME_SCALE),
]


def admission_counts(metrics: str) -> dict[str, float]:
    """`holds/REASON` and `refusals/REASON` from the router's /metrics page."""
    counts = {}
    for line in metrics.splitlines():
        for kind in ("holds", "refusals"):
            prefix = f'memserve_router_admission_{kind}_total{{reason="'
            if line.startswith(prefix):
                reason, value = line[len(prefix) :].split('"} ')
                counts[f"{kind}/{reason}"] = float(value)
    return counts


def test_openai_clients_retrying_429s_all_succeed(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker_args = ["--backend", "sim", "--model-path", str(model_dir)]
    worker_args += ["--time-scale", str(TIME_SCALE)]
    with running("connector.worker", worker_args, tmp_path) as w:
        args = ["--policy", "prompt-tree", "--worker-urls", w.url, *WAIT_ROUTER_ARGS]
        with running("router", args, tmp_path) as r:

            async def burst(n: int) -> list[str]:
                # the SDK's defaults: 2 retries, Retry-After honoured
                client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none")
                model = (await client.models.list()).data[0].id

                async def one(i: int) -> str:
                    # about 500 prompt tokens: 0.4 s of prefill on the slowed sim
                    text = f"question {i}: " + " ".join(f"item{i}x{j}" for j in range(100))
                    out = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": text}], max_tokens=1
                    )
                    return out.choices[0].finish_reason or ""

                try:
                    return await asyncio.gather(*(one(i) for i in range(n)))
                finally:
                    await client.close()

            started = time.monotonic()
            with caplog.at_level(logging.INFO, logger="openai"):
                finished = asyncio.run(burst(8))
            took = time.monotonic() - started
            counts = admission_counts(call(r.url + "/metrics")[1])
            info = call(r.url + "/get_server_info")[1]
    assert len(finished) == 8  # every request succeeded (an error would have raised)
    refused = sum(v for k, v in counts.items() if k.startswith("refusals/"))
    assert refused >= 1, counts  # admission did fire
    assert counts["holds/expected_wait"] >= 1, counts
    # each refusal was retried once by the SDK, after the router's Retry-After (whole seconds)
    retries = [r.getMessage() for r in caplog.records if "Retrying request" in r.getMessage()]
    assert len(retries) == refused, retries
    assert all(m.startswith("Retrying request in 1.000000 seconds") for m in retries), retries
    # a refused request never reached the worker: it served each request once
    assert sum(wk["processed"] for wk in info["workers"]) == 8
    assert took < 20


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "--max-expected-wait-secs must be a number of seconds >= 0"),
        ("nan", "--max-expected-wait-secs must be a number of seconds >= 0"),
        ("soon", "argument --max-expected-wait-secs: invalid float value: 'soon'"),
    ],
)
def test_a_bad_expected_wait_deadline_stops_the_router_at_start(value: str, message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router", "--worker-urls", "http://127.0.0.1:9"]
        + ["--max-expected-wait-secs", value],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_requests_queued_for_a_slot_go_to_an_idle_worker_before_a_busy_holder(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two workers, two slots: one worker holds a long prefix that 8 requests share. Each
    one, seen alone, starts sooner on the holder (the other worker would compute the whole
    prefix), but while requests wait in the router's queue the other worker's idle time is
    lost for good, so the router sends it work (which then holds the prefix too)."""
    worker_args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "1"]
    prefix = " ".join(f"word{i % 97} part{i % 89}" for i in range(900))
    with (
        running("connector.worker", worker_args, tmp_path) as a,
        running("connector.worker", worker_args, tmp_path) as b,
    ):
        args = ["--policy", "prompt-tree", "--worker-urls", a.url, b.url]
        args += ["--max-concurrent-requests", "2", "--queue-size", "100"]
        with running("router", args, tmp_path) as r:

            def send(suffix: str) -> None:
                body = {"text": f"{prefix} {suffix}", "sampling_params": {"max_new_tokens": 24}}
                status, answer = call(r.url + "/generate", body)
                assert status == 200, answer

            send("first")  # one worker now holds the prefix
            threads = [threading.Thread(target=send, args=(f"q{i}",)) for i in range(10)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            events = [
                line
                for line in call(r.url + "/metrics")[1].splitlines()
                if line.startswith("sgl_router_load_balancing_events_total")
            ]
            served = {
                w["url"]: w["processed"] for w in call(r.url + "/get_server_info")[1]["workers"]
            }
    holder, other = sorted(served.values(), reverse=True)
    assert holder + other == 11 and other >= 1, served
    assert any('reason="idle"' in line for line in events), events  # why, in the metrics
