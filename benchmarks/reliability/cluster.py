"""The processes a scenario breaks: sim workers (launched by `localrun.cluster`) and routers
on free loopback ports, broken by real signals to their pids; a worker's MemPool counted
through its /get_server_info."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from localrun.cluster import Cluster as Workers
from localrun.cluster import ClusterSpec, scrape
from localrun.processes import Launch, Server, free_port, module_command, start_all, stop_all

ROUTER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MEMSERVE_ROUTER_PROCESSES": "1",
}
BOOT_S = 60.0
# A dead or frozen worker is noticed within about 2 s (2 failures 0.5 s apart, 1 s timeout).
HEALTH = [
    *("--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "1"),
    *("--health-failure-threshold", "2", "--health-success-threshold", "1"),
]
PD_TIMEOUT_S = "20"  # the PD workers' --disaggregation-timeout-secs


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def metric(server: Server, name: str) -> float:
    """A metric from a server's /metrics, summed over its labels; 0 when not exported."""
    return scrape(server.url + "/metrics").get(name, 0.0)


@dataclass(frozen=True)
class PoolCount:
    """One worker's MemPool: blocks allocated, blocks the index holds, pages pinned."""

    used: int
    indexed: int
    pinned: int

    @property
    def leaked(self) -> int:
        """With no request running, what a request, transfer or pull left behind."""
        return max(self.used - self.indexed, 0) + self.pinned

    @classmethod
    def of(cls, worker: Server) -> PoolCount:
        pool = get_json(worker.url + "/get_server_info")["mempool"]
        used = sum(t["used"] for t in pool["tiers"].values())
        pages = pool["cached_tokens"] // pool["page_size"]
        per_page = 1  # aggregated; discrete: 2 x layers blocks a page
        if pool["layout"] != "aggregated" and pages:
            per_page = max(used // pages, 1)
        return cls(used, pages * per_page, pool["protected_pages"])


@dataclass
class Cluster:
    """Servers a scenario started; every one is stopped by pid when the scenario ends."""

    logs: Path
    model_dir: Path
    servers: list[Server] = field(default_factory=list)
    launches: dict[int, Launch] = field(default_factory=dict)  # by port, for restarts

    def __post_init__(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)

    def start(self, launches: Sequence[Launch]) -> list[Server]:
        started = start_all(launches, BOOT_S)
        self.servers += started
        self.launches.update({launch.port: launch for launch in launches})
        return started

    def plan(self, spec: ClusterSpec) -> Workers:
        """`spec`'s workers (with a 4,096-token context), launched by localrun, not started."""
        n = len(self.launches)
        args = ("--context-length", "4096", *spec.worker_args)
        return Workers.create(
            replace(spec, name=f"w{n}", worker_args=args), self.model_dir, self.logs, first_id=n + 1
        )

    def workers(self, n: int, *extra: str, time_scale: float = 0.02) -> list[Server]:
        spec = ClusterSpec("", colocated=n, time_scale=time_scale, worker_args=extra)
        return self.start([w.launch for w in self.plan(spec).workers])

    def router(self, args: Sequence[str]) -> Server:
        port = free_port()
        command = module_command("router", port, [*args, *HEALTH])
        log = self.logs / f"router-{port}.log"
        return self.start([Launch(f"router-{port}", command, port, log, env=ROUTER_ENV)])[0]

    def colocated_router(self, workers: Sequence[Server], *extra: str) -> Server:
        urls = [w.url for w in workers]
        return self.router(["--policy", "prompt-tree", "--worker-urls", *urls, *extra])

    def pd(
        self, decodes: int, *extra: str, time_scale: float, decode_extra: Sequence[str] = ()
    ) -> tuple[Server, Server, list[Server]]:
        """One prefill and `decodes` decodes (caching-3; `decode_extra`: the decodes' own
        flags) behind a router in PD mode: (router, prefill, decodes)."""
        args = ("--disaggregation-timeout-secs", PD_TIMEOUT_S, *extra)
        spec = ClusterSpec("", prefills=1, decodes=decodes, caching="caching-3")
        prefill, *rest = self.plan(replace(spec, time_scale=time_scale, worker_args=args)).workers
        more = [replace(w.launch, args=[*w.launch.args, *decode_extra]) for w in rest]
        started = self.start([prefill.launch, *more])
        router = ["--policy", "round_robin", "--pd-caching", "caching-3", "--prefill"]
        router += [started[0].url, str(prefill.bootstrap_port)]
        router += [arg for d in started[1:] for arg in ("--decode", d.url)]
        return self.router(router), started[0], started[1:]

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
        fresh = start_all([self.launches[server.port]], BOOT_S)[0]
        self.servers = [fresh if s is server else s for s in self.servers]
        return fresh

    def stop(self) -> None:
        for server in self.servers:  # a frozen process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                if server.exited() is None:
                    os.kill(server.proc.pid, signal.SIGCONT)
        stop_all(self.servers, timeout=5)

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
    """Blocks each live worker still holds once its in-flight work had time to end
    (transfers and write-backs finish after the answers); -1: could not be counted."""
    deadline = time.monotonic() + timeout
    while True:
        leaked = {}
        for worker in workers:
            if worker.exited() is None:
                try:
                    leaked[worker.url] = PoolCount.of(worker).leaked
                except (OSError, ValueError, KeyError):
                    leaked[worker.url] = -1
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
