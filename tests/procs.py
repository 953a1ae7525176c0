"""The tests' servers: localrun.processes with the tests' defaults (repository root, offline)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from localrun import processes as procs
from localrun.processes import Server, free_port, stop_process, wait_healthy

__all__ = [
    "ROOT",
    "Server",
    "free_port",
    "run_module",
    "running",
    "stop",
    "stop_process",
    "wait_healthy",
]

ROOT = Path(__file__).resolve().parents[1]
# No downloads, no tokenizer thread pool that warns when a worker forks, and one router
# process unless a test asks for more (--processes).
TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MEMSERVE_ROUTER_PROCESSES": "1",
}


def stop(server: Server) -> None:
    server.stop()


@contextlib.contextmanager
def running(
    module: str, args: list[str], log_dir: Path, timeout: float = 120, port: int | None = None
) -> Iterator[Server]:
    """`python -m module --port P args...` from the repository root, healthy before the
    block runs, stopped after."""
    with procs.running(module, args, log_dir, timeout, port, ROOT, TEST_ENV) as server:
        yield server


def run_module(
    module: str, args: list[str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`python -m module args...` from the repository root, run to its end (a startup error's
    exit code and message)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, **TEST_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
