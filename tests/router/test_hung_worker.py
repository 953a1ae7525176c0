"""A worker that hangs (SIGSTOP: its socket accepts, nothing answers) must not hold the
router's requests until --request-timeout-secs: once its health checks fail, requests not
yet answered go to another worker and a stream it was sending ends with an error event."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from benchmarks.reliability.client import Seen, post
from tests.procs import running

FROZEN_S = 20.0  # far past what any request below may take
HEALTH = ["--health-check-interval-secs", "0.3", "--health-check-timeout-secs", "0.5"]
HEALTH += ["--health-failure-threshold", "2"]


def sim(model_dir: Path, scale: str) -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", scale]


def test_requests_waiting_on_a_hung_worker_go_elsewhere(model_dir: Path, tmp_path: Path) -> None:
    with (
        running("connector.worker", sim(model_dir, "0.5"), tmp_path) as hung,
        running("connector.worker", sim(model_dir, "0"), tmp_path) as other,
        running(
            "router", ["--policy", "round_robin", "--worker-urls", hung.url, *HEALTH], tmp_path
        ) as only_hung,
        running(
            "router",
            ["--policy", "round_robin", "--worker-urls", hung.url, other.url, *HEALTH],
            tmp_path,
        ) as both,
    ):
        body = {"text": "a long story", "stream": True, "sampling_params": {"max_new_tokens": 3000}}
        frozen = threading.Event()
        streamed: list[Seen] = []

        def freeze_at(n: int) -> None:
            if n == 2:
                os.kill(hung.proc.pid, signal.SIGSTOP)
                frozen.set()

        stream = threading.Thread(
            target=lambda: streamed.append(
                post(only_hung.url + "/generate", body, 15, on_event=freeze_at)
            )
        )
        stream.start()
        try:
            assert frozen.wait(15)
            started = time.monotonic()
            answers = [post(both.url + "/generate", {"text": f"hi {i}"}, 15) for i in range(4)]
            stream.join(15)
            assert time.monotonic() - started < 10
            assert all(a.ok for a in answers), [a.summary() for a in answers]
            (seen,) = streamed
            assert seen.status == 200 and seen.done and not seen.hung, seen
            assert seen.error is not None and "stopped answering" in seen.error
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        # awake again: the router takes it back
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if post(only_hung.url + "/generate", {"text": "back?"}, 10).ok:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the worker was never taken back")
