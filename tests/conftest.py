"""Shared fixtures: the converted tiny model (made once per machine and cached), redis-server."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from localrun import processes as procs
from localrun.processes import free_port, stop_process


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker picks its servers' ports in a slice of its own (its
    children inherit it through the environment), so two tests side by side never start two
    servers on one port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and count > 1:
        first, end = procs.picked_range()
        size = (end - first) // count
        low = first + int(worker[2:]) * size
        os.environ[procs.PORT_RANGE_ENV] = f"{low}-{low + size}"


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
    port = port or free_port()
    runs = len(list(log_dir.glob(f"redis-{port}*.log")))
    log = log_dir / (f"redis-{port}.log" if not runs else f"redis-{port}-{runs + 1}.log")
    try:
        server = procs.start_redis(log, timeout, port)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return RedisServer(procs.redis_url(server), port, server.proc)


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
