"""The processes a scenario breaks: sim workers and routers on free loopback ports.

Faults are real signals to real pids: SIGKILL (a crash), SIGSTOP/SIGCONT (a process that
keeps its sockets open and never answers), a restart on the same port (the pool heals). A
worker's MemPool is counted through its /get_server_info: blocks in use against blocks the
index holds, and pages still pinned; after a fault both must come back to "nothing held".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.cluster import scrape
from localrun.processes import Launch, Server, free_port, module_command, start_all, stop_all

ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MEMSERVE_ROUTER_PROCESSES": "1"}
BOOT_S = 60.0
# The router's health checks in every scenario: a dead or frozen worker is noticed within
# about two seconds (2 failures, 0.5 s apart, 1 s timeout each).
HEALTH = [
    "--health-check-interval-secs",
    "0.5",
    "--health-check-timeout-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
]


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def metric(server: Server, name: str) -> float:
    """A counter or gauge from a server's /metrics, summed over its labels; 0 when it is not
    exported."""
    return scrape(server.url + "/metrics").get(name, 0.0)


@dataclass(frozen=True)
class PoolCount:
    """One worker's MemPool: blocks allocated, blocks the index holds, pages pinned."""

    used: int
    indexed: int
    pinned: int

    @property
    def leaked(self) -> int:
        """Blocks allocated that no cache entry holds, plus pinned pages: with no request
        running, both are what a request, transfer or pull left behind."""
        return max(self.used - self.indexed, 0) + self.pinned

    @classmethod
    def of(cls, worker: Server) -> PoolCount:
        pool = get_json(worker.url + "/get_server_info")["mempool"]
        used = sum(t["used"] for t in pool["tiers"].values())
        pages = pool["cached_tokens"] // pool["page_size"]
        per_page = 1 if pool["layout"] == "aggregated" else None
        if per_page is None:  # discrete: 2 x layers blocks a page
            per_page = max(used // max(pages, 1), 1) if pages else 1
        return cls(used, pages * per_page, pool["protected_pages"])


@dataclass
class Cluster:
    """Servers a scenario started; every one is stopped by pid when the scenario ends."""

    logs: Path
    model_dir: Path
    servers: list[Server] = field(default_factory=list)
    launches: dict[int, Launch] = field(default_factory=dict)  # by port, for restarts

    def start(self, launches: Sequence[Launch]) -> list[Server]:
        started = start_all(launches, BOOT_S)
        self.servers += started
        self.launches.update({launch.port: launch for launch in launches})
        return started

    def worker_launch(self, *extra: str, time_scale: float = 0.02) -> Launch:
        port = free_port()
        args = ["--backend", "sim", "--model-path", str(self.model_dir)]
        args += ["--time-scale", str(time_scale), "--context-length", "4096", *extra]
        name = f"worker-{port}"
        return Launch(
            name, module_command("connector.worker", port, args), port, self._log(name), env=ENV
        )

    def workers(self, n: int, *extra: str, time_scale: float = 0.02) -> list[Server]:
        return self.start([self.worker_launch(*extra, time_scale=time_scale) for _ in range(n)])

    def router(self, args: Sequence[str], port: int | None = None) -> Server:
        port = port or free_port()
        name = f"router-{port}"
        launch = Launch(
            name, module_command("router", port, [*args, *HEALTH]), port, self._log(name), env=ENV
        )
        return self.start([launch])[0]

    def colocated_router(self, workers: Sequence[Server], *extra: str) -> Server:
        urls = [w.url for w in workers]
        return self.router(["--policy", "prompt-tree", "--worker-urls", *urls, *extra])

    def _log(self, name: str) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        return self.logs / f"{name}.log"

    # ----------------------------------------------------------------- faults

    @staticmethod
    def kill(server: Server) -> None:
        """SIGKILL: a crash, no goodbye on any socket."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()

    @staticmethod
    def freeze(server: Server) -> None:
        """SIGSTOP: its sockets stay open and accept, nothing answers."""
        os.kill(server.proc.pid, signal.SIGSTOP)

    @staticmethod
    def thaw(server: Server) -> None:
        os.kill(server.proc.pid, signal.SIGCONT)

    def restart(self, server: Server) -> Server:
        """The same command on the same port, healthy again (a supervisor's restart)."""
        if server.exited() is None:
            self.kill(server)
        launch = self.launches[server.port]
        fresh = start_all([launch], BOOT_S)[0]
        self.servers = [fresh if s is server else s for s in self.servers]
        return fresh

    def stop(self) -> None:
        for server in self.servers:  # a frozen process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                if server.exited() is None:
                    os.kill(server.proc.pid, signal.SIGCONT)
        stop_all(self.servers, timeout=5)

    # ----------------------------------------------------------------- what the router sees

    @staticmethod
    def router_view(router: Server) -> dict[str, bool]:
        """Each worker URL -> healthy, as the router sees it now."""
        return {w["url"]: bool(w["healthy"]) for w in get_json(router.url + "/workers")["workers"]}

    def wait_health(
        self, router: Server, url: str, healthy: bool, timeout: float = 15
    ) -> float | None:
        """Seconds until the router sees `url` as healthy (or not); None if it never does."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(OSError, ValueError):
                if self.router_view(router).get(url) is healthy:
                    return time.monotonic() - started
            time.sleep(0.1)
        return None


def settled_leak(workers: Sequence[Server], timeout: float = 10.0) -> dict[str, int]:
    """Blocks each live worker leaked, once its in-flight work had time to end (transfers
    and write-backs finish after the answers): a leak is what is still held at the end."""
    deadline = time.monotonic() + timeout
    leaked: dict[str, int] = {}
    while True:
        leaked = {}
        for worker in workers:
            if worker.exited() is None:
                try:
                    leaked[worker.url] = PoolCount.of(worker).leaked
                except (OSError, ValueError, KeyError):
                    leaked[worker.url] = -1  # could not be counted: reported, never hidden
        if all(v == 0 for v in leaked.values()) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


@contextlib.contextmanager
def cluster(logs: Path, model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(logs, model_dir)
    try:
        yield c
    finally:
        c.stop()
