"""Admission limits in-process (the token bucket, the queue) and over HTTP (429s)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from router.admission import Admission, Limits, Refused, TokenBucket
from tests.procs import running


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
