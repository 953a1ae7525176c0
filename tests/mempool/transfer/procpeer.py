"""Start peer_proc in a child process, read its ready line, stop or kill it by pid."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.procs import ROOT


@dataclass
class Peer:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log: Path

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _ready_line(proc: subprocess.Popen[str], timeout: float) -> str:
    out = proc.stdout
    assert out is not None, "started with stdout=PIPE"
    ready, _, _ = select.select([out], [], [], timeout)
    return out.readline() if ready else ""


@contextlib.asynccontextmanager
async def peer_process(log_dir: Path, *args: str, timeout: float = 15.0) -> AsyncIterator[Peer]:
    """The child runs while the block runs; its ready line is read off the event loop, so
    agents in this process keep serving (a sender child connects to them)."""
    log = log_dir / f"peer-{len(list(log_dir.glob('peer-*')))}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mempool.transfer.peer_proc", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    peer = Peer(proc, {}, log)
    try:
        line = await asyncio.to_thread(_ready_line, proc, timeout)
        if not line:
            peer.kill()
            raise RuntimeError(f"peer_proc {args} not ready: {log.read_text()[-2000:]}")
        peer.ready = json.loads(line)
        yield peer
    finally:
        peer.kill()
        if proc.stdout is not None:
            proc.stdout.close()


async def eventually(predicate: Any, timeout: float, step: float = 0.05) -> float:
    """Seconds until `predicate()` held; AssertionError if it did not within `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still false after {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - start
