"""What every benchmark shares: stopped by SIGTERM, it stops the servers it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import ROOT


def children(pid: int) -> set[int]:
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            out.update(
                int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            )
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_servers_a_benchmark_started(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.router_overhead", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        started: set[int] = set()
        while time.monotonic() < deadline and len(started) < 2 and bench.poll() is None:
            started |= children(bench.pid)
            time.sleep(0.2)
        assert started, "the benchmark started no server"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) != 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in started):
            time.sleep(0.2)
        assert not [p for p in started if alive(p)], "servers left running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
