"""`python -m router --processes N`: N router processes serving one port.

The supervisor binds nothing itself. It makes the router's private directory (the
processes' ipc sockets, router.siblings, and prometheus-client's multiprocess files),
starts the local workers when no worker is named, then N children: `python -m router`
with the same arguments plus their index. Each child binds the port with SO_REUSEPORT, so
the kernel spreads incoming connections over them, and they share their state over the
local channel (router.siblings).

It forwards SIGTERM and SIGINT to the children, and SIGHUP (each reads its tenants file
again); a child whose supervisor dies without
stopping it (SIGKILL, the OOM killer) gets SIGTERM from the kernel (Linux's parent-death
signal), so no orphan keeps serving the port beside a restarted router. When a child exits
on its own the supervisor stops the others and exits with an error: a router missing a
process would go on serving with part of the capacity it was given, silently, and a
restarted child would have missed what the others learned; a process manager restarts the
whole router, whose processes start together and share their state from the beginning. The
directory is removed at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

POLL_S = 0.1
STOP_TIMEOUT_S = 15.0  # a child that has not stopped by then is killed
METRICS_DIR = "metrics"


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, or fewer when its cgroup's CPU
    quota (a container's CPU limit) allows fewer; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(cores, 1)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, or v1's CFS quota), None
    when unlimited or unknown."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    return None


SUPERVISOR_ENV = "MEMSERVE_ROUTER_SUPERVISOR"  # the supervisor's pid, in its children's env
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_supervisor() -> None:
    """In a child: SIGTERM when the supervisor that started it dies (Linux; elsewhere a
    no-op), or at once if it died before this ran."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != supervisor:  # already gone: adopted by init or a subreaper
        os.kill(os.getpid(), signal.SIGTERM)


def child_command(argv: Sequence[str], index: int, count: int, directory: Path) -> list[str]:
    """The same command line with this child's place among the processes."""
    place = ["--process-index", str(index), "--process-count", str(count)]
    return [sys.executable, "-m", "router", *argv, *place, "--process-dir", str(directory)]


def supervise(argv: Sequence[str], count: int) -> int:
    """Run `count` children of `python -m router argv` until a signal or a child's exit;
    the exit status: 0 after a signal, 1 when a child exited on its own."""
    directory = Path(tempfile.mkdtemp(prefix="memserve-router-"))  # private: mode 0700
    (directory / METRICS_DIR).mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(directory / METRICS_DIR),
        SUPERVISOR_ENV: str(os.getpid()),
    }
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop_all(signum: int | None = None, frame: FrameType | None = None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    def forward(signum: int, frame: FrameType | None = None) -> None:
        for child in children:  # SIGHUP: each process reads its files again (--tenants)
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, forward)
    failed = False
    try:
        for i in range(count):
            command = child_command(argv, i, count, directory)
            children.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        pids = " ".join(str(c.pid) for c in children)
        print(f"router: {count} processes (pids {pids})", flush=True)
        while any(c.poll() is None for c in children):
            exited = [(i, c.returncode) for i, c in enumerate(children) if c.poll() is not None]
            if exited and not stopping:
                index, code = exited[0]
                log.error("router process %d exited with %s: stopping the router", index, code)
                failed = True
                stop_all()
            if stopping:
                _wait(children, STOP_TIMEOUT_S)
                break
            time.sleep(POLL_S)
        failed = failed or (not stopping and any(c.returncode for c in children))
    finally:
        stop_all()
        _wait(children, STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(directory, ignore_errors=True)
    return 1 if failed else 0


def _wait(children: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every child to exit; SIGKILL whichever has not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            log.error("router process %d did not stop: killed", child.pid)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait()
