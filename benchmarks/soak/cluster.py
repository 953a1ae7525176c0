"""The processes (sim workers from `localrun.cluster`, our router from
`benchmarks.multiturn.cluster`) and the MemPool accounting check once the load has stopped."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.load.bodies import served_model
from benchmarks.multiturn.cluster import RouterSpec, RunningRouter, start_router
from benchmarks.peers import OURS
from benchmarks.soak.config import Config
from benchmarks.soak.sampler import Proc, worker_gauges
from localrun.cluster import Cluster, ClusterSpec
from localrun.processes import Server

POLICY = "prompt-tree"
SETTLE_TIMEOUT_S = 30.0


@dataclass
class Running:
    cluster: Cluster
    router: RunningRouter

    @property
    def url(self) -> str:
        return self.router.url

    def procs(self) -> list[Proc]:
        out = [Proc("router", self.router.server.proc.pid, "router", self.router.url)]
        for w in self.cluster.workers:
            assert w.pid is not None
            out.append(Proc(w.name, w.pid, w.role, w.url))
        return out

    def servers(self) -> dict[str, Server]:
        """The router and every worker, by the name they are reported under."""
        out = {"router": self.router.server}
        out.update({w.name: w.server for w in self.cluster.workers if w.server is not None})
        return out

    def exit_codes(self) -> dict[str, int | None]:
        return {name: s.exited() for name, s in self.servers().items()}

    def log_tails(self) -> dict[str, str]:
        return {name: s.tail(12) for name, s in self.servers().items()}

    def stop(self) -> None:
        self.router.server.stop()
        self.cluster.stop()


def cluster_spec(config: Config) -> ClusterSpec:
    """3 colocated sim workers, or one caching-3 prefill and decode pair (`--pd`)."""
    pd = config.pd
    return ClusterSpec(
        "soak-pd" if pd else "soak",
        colocated=0 if pd else config.workers,
        prefills=int(pd),
        decodes=int(pd),
        caching="caching-3" if pd else None,
        label="1P1D-CC" if pd else "",
        time_scale=config.time_scale,
        max_total_tokens=config.max_total_tokens,
    )


def start(config: Config, model_dir: Path, log_dir: Path) -> Running:
    """Workers first (in parallel), then the router once a chat goes through it; whatever
    started is stopped again if something does not come up."""
    cluster = Cluster.create(cluster_spec(config), model_dir, log_dir, None)
    cluster.start()
    try:
        model = served_model(cluster.workers[0].url)
        router = start_router(RouterSpec(OURS, POLICY), cluster, log_dir, model)
    except BaseException:
        cluster.stop()
        raise
    return Running(cluster, router)


def server_info(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
            answer = json.load(resp)
    except (OSError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


def balanced(g: dict[str, float]) -> bool:
    """Idle, every allocated block indexed, nothing pinned (the tests' `no_leak`)."""
    return (
        g["running"] == 0
        and g["waiting"] == 0
        and g["used_blocks"] == g["indexed_blocks"]
        and g["protected_pages"] == 0
    )


def mempool_accounting(
    running: Running, timeout_s: float = SETTLE_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Per worker, once the load has stopped: blocks used vs indexed and pinned pages, polled
    until they balance (a PD write-back or an abort's cleanup may still be under way) or
    `timeout_s` passes; `balanced` says which, `settle_s` how long it took."""
    start = time.monotonic()
    out = []
    for w in running.cluster.workers:
        while True:
            info = server_info(w.url)
            g = worker_gauges(info, {}) if info else {}
            ok = bool(g) and balanced(g)
            if ok or time.monotonic() - start > timeout_s:
                break
            time.sleep(0.25)
        out.append(
            {
                "worker": w.name,
                "role": w.role,
                "reachable": bool(g),
                "used_blocks": g.get("used_blocks"),
                "indexed_blocks": g.get("indexed_blocks"),
                "protected_pages": g.get("protected_pages"),
                "running": g.get("running"),
                "waiting": g.get("waiting"),
                "balanced": ok,
                "settle_s": round(time.monotonic() - start, 2),
            }
        )
    return out
