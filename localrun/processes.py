"""Servers as child processes on free loopback ports: start, wait until ready, stop by pid.

One module for every place that runs our servers or the peers' as real processes: the
router's local workers (`localrun.cluster`), the benchmarks and the tests.
Nothing started here listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
JSON_HEADERS = {"Content-Type": "application/json"}


def auth_headers(api_key: str) -> dict[str, str]:
    """JSON headers with `Authorization: Bearer <api_key>` (a tenant's or the operator's)."""
    return {**JSON_HEADERS, "Authorization": f"Bearer {api_key}"}


STOP_TIMEOUT_S = 10.0


PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PICKED_PORT = 20000  # below the kernel's ephemeral range on every usual setting
PORT_RANGE_ENV = "MEMSERVE_PORT_RANGE"
_picked_ports: set[int] = set()
_port_random = random.SystemRandom()  # not the module's: forked children share its state


def free_port() -> int:
    """A loopback port nobody listens on right now, which no outgoing connection will take
    before the server binds it, and never the same twice in this process.

    A server started as a process binds seconds after its port is picked. The kernel's own
    pick (bind to port 0) comes from the ephemeral range, where connect() also takes its
    source ports, so any connection made meanwhile could take it; this picks at random
    below that range instead, and falls back to the kernel's pick where there is no room.
    """
    first, low = picked_range()
    if low - first >= 1000:
        for _ in range(100):
            port = _port_random.randrange(first, low)
            if port not in _picked_ports and can_bind(port):
                _picked_ports.add(port)
                return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = int(s.getsockname()[1])
        if port not in _picked_ports:
            _picked_ports.add(port)
            return port
    raise RuntimeError("no free loopback port: 200 picks were all taken")


def picked_range() -> tuple[int, int]:
    """Where `free_port` picks: below the ephemeral range, or the slice `MEMSERVE_PORT_RANGE`
    (`LOW-HIGH`) names, so that test runs side by side (pytest-xdist's workers, and the
    processes each starts) never pick the same port."""
    named = os.environ.get(PORT_RANGE_ENV, "")
    if named:
        low, _, high = named.partition("-")
        return int(low), int(high)
    return FIRST_PICKED_PORT, ephemeral_ports()[0]


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for connect()'s source ports (Linux's default where unreadable)."""
    try:
        low, high = PORT_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def can_bind(port: int) -> bool:
    """Whether a listening socket on the loopback could take `port` right now."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def module_command(module: str, port: int, args: Sequence[str] = ()) -> list[str]:
    """`python -m module --host 127.0.0.1 --port P args...` with this interpreter."""
    return [sys.executable, "-m", module, "--host", LOOPBACK, "--port", str(port), *args]


@dataclass
class Server:
    """A running server process and the loopback port it serves on; stopped by its pid."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path | None = None  # its stdout and stderr; None: it shares ours
    name: str = "server"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def output(self, chars: int = 4000) -> str:
        """The end of its log, for error messages."""
        if self.log is None:
            return ""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def tail(self, lines: int = 6) -> str:
        """Its log's last lines on one line, short enough for a results table."""
        text = self.output().strip()
        return " | ".join(line.strip() for line in text.splitlines()[-lines:])

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        stop_process(self.proc, timeout)


@dataclass(frozen=True)
class Launch:
    """How to start one server: its command line, port and log; `start` runs it."""

    name: str
    args: list[str]
    port: int
    log: Path | None = None  # None: the child writes to our stdout and stderr
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # added to this process's

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> Server:
        env = {**os.environ, **self.env} if self.env else None
        if self.log is None:
            proc = subprocess.Popen(self.args, cwd=self.cwd, env=env)
        else:
            with self.log.open("w") as out:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen(
                    self.args, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT
                )
        return Server(proc, self.port, self.log, self.name)


def http_ok(
    url: str, body: bytes | None = None, timeout: float = 5, api_key: str | None = None
) -> bool:
    """GET (POST with `body`) answers 200 (`api_key`: sent as a bearer token); an HTTP error
    status is False, a refused connection raises (OSError), so callers can tell "up but
    failing" from "not up"."""
    headers = JSON_HEADERS if api_key is None else auth_headers(api_key)
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return bool(resp.status == 200)
    except urllib.error.HTTPError:
        return False


def wait_until(
    server: Server,
    probe: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.2,
    full_log: bool = False,
) -> str | None:
    """None once `probe()` holds; else why not (the process exited, or time ran out), with
    the log's last lines (its last 4,000 characters with `full_log`)."""
    deadline = time.monotonic() + timeout_s
    why = f"{server.name} not ready after {timeout_s:.0f} s"
    while time.monotonic() < deadline:
        code = server.exited()
        if code is not None:
            why = f"{server.name} exited with {code}"
            break
        with contextlib.suppress(OSError, ValueError):
            if probe():
                return None
        time.sleep(poll_s)
    sep, detail = (":\n", server.output()) if full_log else (": ", server.tail())
    return why + sep + detail if detail else why


def start_redis(log: Path, timeout_s: float = 10.0, port: int | None = None) -> Server:
    """A private redis-server on a loopback port (a free one, or `port`: a restart where the
    last one was) that keeps nothing on disk (what it holds, its users rebuild), answering
    PING. RuntimeError, the server stopped, if it does not come up."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/install.sh installs it)")
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
    server = Launch("redis", [*args, "--dir", str(log.parent)], port, log).start()
    why = wait_until(server, lambda: redis_pong(port), timeout_s, poll_s=0.05)
    if why is not None:
        server.stop(5)
        raise RuntimeError(why)
    return server


def redis_pong(port: int) -> bool:
    with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def redis_url(server: Server) -> str:
    return f"redis://{LOOPBACK}:{server.port}/0"


def healthy(server: Server) -> Callable[[], bool]:
    """The readiness probe of our servers and SGLang's: GET /health answers 200."""
    return lambda: http_ok(server.url + "/health", timeout=1)


def wait_healthy(
    server: Server, timeout: float, poll_s: float = 0.1, full_log: bool = True
) -> None:
    """Returns once the server is healthy; RuntimeError (with its log) if it never is."""
    why = wait_until(server, healthy(server), timeout, poll_s, full_log)
    if why is not None:
        raise RuntimeError(why)


def start_all(
    launches: Sequence[Launch], timeout_s: float, poll_s: float = 0.2, full_log: bool = False
) -> list[Server]:
    """Start every server at once (they boot in parallel), then wait until each is healthy;
    if one is not, stop them all and raise RuntimeError saying why."""
    servers = [launch.start() for launch in launches]
    try:
        for server in servers:
            wait_healthy(server, timeout_s, poll_s, full_log)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM by pid, then SIGKILL if it has not exited within `timeout` seconds."""
    stop_processes([proc], timeout)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM to every live one first (they shut down in parallel), then SIGKILL by pid
    whichever has not exited `timeout` seconds later."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_all(servers: Sequence[Server], timeout: float = STOP_TIMEOUT_S) -> None:
    stop_processes([s.proc for s in servers], timeout)


@contextlib.contextmanager
def running(
    module: str,
    args: list[str],
    log_dir: Path,
    timeout: float = 120,
    port: int | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """`python -m module --port P args...`, healthy before the block runs, stopped after."""
    port = port or free_port()
    log = log_dir / f"{module.replace('.', '_')}-{port}.log"
    server = Launch(module, module_command(module, port, args), port, log, cwd, env or {}).start()
    try:
        wait_healthy(server, timeout)
        yield server
    finally:
        server.stop()
