"""Shared fixtures: the converted tiny model (made once per machine and cached), redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import stop_process


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from connector.model_files import ensure_hf_model

    return ensure_hf_model()


@dataclass
class RedisServer:
    """A private redis-server: `url` to connect, `proc` to stop or kill it."""

    url: str
    port: int
    proc: subprocess.Popen


def start_redis(log_dir: Path, timeout: float = 10.0) -> RedisServer:
    """redis-server on a free loopback port without persistence, answering PING."""
    from tests.procs import free_port

    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    port = free_port()
    log = log_dir / f"redis-{port}.log"
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [binary, *args, "--dir", str(log_dir)], stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"redis-server exited with {proc.returncode}; see {log.name}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return RedisServer(f"redis://127.0.0.1:{port}/0", port, proc)
        except OSError:
            time.sleep(0.05)
    stop_redis(RedisServer("", port, proc))
    pytest.fail(f"redis-server did not answer on port {port} within {timeout}s")


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
