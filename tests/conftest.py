"""Shared fixtures: the converted tiny model (made once per machine and cached), redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from router.procs import LOOPBACK, Launch, free_port, stop_process, wait_until


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from connector.model_files import ensure_hf_model

    return ensure_hf_model()


@dataclass
class RedisServer:
    """A private redis-server: `url` to connect, `proc` to stop or kill it."""

    url: str
    port: int
    proc: subprocess.Popen[bytes]


def start_redis(log_dir: Path, timeout: float = 10.0, port: int | None = None) -> RedisServer:
    """redis-server on a free loopback port (or `port`: a restart where the last one was)
    without persistence, answering PING."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
    args += ["--dir", str(log_dir)]
    runs = len(list(log_dir.glob(f"redis-{port}*.log")))
    log = log_dir / (f"redis-{port}.log" if not runs else f"redis-{port}-{runs + 1}.log")
    server = Launch("redis-server", args, port, log).start()
    why = wait_until(server, lambda: pong(port), timeout, poll_s=0.05)
    if why is not None:
        server.stop(5)
        pytest.fail(why)
    return RedisServer(f"redis://{LOOPBACK}:{port}/0", port, server.proc)


def pong(port: int) -> bool:
    with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def stop_redis(server: RedisServer) -> None:
    stop_process(server.proc, 5)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        stop_redis(server)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of a private redis-server for this test (stopped by pid afterwards)."""
    return redis_server.url
