"""Start the project's servers as real processes on free loopback ports; stop them by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.output()}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(server.url + "/health", timeout=1) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{server.output()}")


def stop(server: Server) -> None:
    stop_process(server.proc, 10)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM by pid, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def running(
    module: str, args: list[str], log_dir: Path, timeout: float = 120, port: int | None = None
) -> Iterator[Server]:
    """`python -m module --port P args...`, healthy before the block runs, stopped after."""
    port = port or free_port()
    log = log_dir / f"{module.replace('.', '_')}-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
    server = Server(proc, port, log)
    try:
        wait_healthy(server, timeout)
        yield server
    finally:
        stop(server)
