"""The processes (sim workers from `localrun.cluster`, our router as `benchmarks.multiturn`
starts it), what is sampled from them every few seconds, and the MemPool check at the end.

RSS is VmRSS of each process and of every descendant, each its own series (a leak in a
helper shows apart from its parent). Gauges come from /get_server_info and /metrics; one that
could not be read is missing from its sample, not zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import children, rss_mib
from benchmarks.load.bodies import served_model
from benchmarks.multiturn.cluster import RouterSpec, RunningRouter, start_router
from benchmarks.peers import OURS
from localrun.cluster import Cluster, ClusterSpec, cpu_seconds, scrape
from localrun.processes import Server

POLICY = "prompt-tree"
GAUGE_TIMEOUT_S = 5.0
SETTLE_TIMEOUT_S = 30.0
ACCOUNTED = ("used_blocks", "indexed_blocks", "protected_pages", "running", "waiting")


@dataclass(frozen=True)
class Proc:
    """A process to watch: the name it is reported under, its pid, role and base URL."""

    name: str
    pid: int
    role: str  # router | colocated | prefill | decode
    url: str


@dataclass
class Sample:
    t: float  # seconds since the load began (negative: before it)
    rss_mib: dict[str, float]  # process name -> MiB (children as "parent/child pid comm")
    cpu_s: dict[str, float]
    gauges: dict[str, dict[str, float]]  # process name -> gauge -> value


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def picked(metrics: dict[str, float], **names: str) -> dict[str, float]:
    """The `metrics` that were exported, under their short names (short=metric)."""
    return {short: metrics[name] for short, name in names.items() if name in metrics}


def router_gauges(info: dict[str, Any], metrics: dict[str, float]) -> dict[str, float]:
    tokenizer = info.get("tokenizer") or {}
    workers = info.get("workers") or []
    out = {
        "tree_pages": float(sum((info.get("tree_pages") or {}).values())),
        "tokenizer_cached_tokens": float(tokenizer.get("cached_tokens") or 0),
        "in_flight": float(sum(w.get("in_flight") or 0 for w in workers)),
        "healthy_workers": float(sum(1 for w in workers if w.get("healthy"))),
    }
    return out | picked(
        metrics,
        requests="sgl_router_requests_total",
        tree_expired_pages="memserve_router_tree_expired_pages_total",
        retries="sgl_router_retries_total",
        predicted_cached_tokens="memserve_router_predicted_cached_tokens_total",
        reported_cached_tokens="memserve_router_reported_cached_tokens_total",
    )


def worker_gauges(info: dict[str, Any], metrics: dict[str, float]) -> dict[str, float]:
    pool = info.get("mempool") or {}
    page = int(pool.get("page_size") or info.get("page_size") or 16)
    states = (info.get("internal_states") or [{}])[0]
    out = {
        "used_blocks": float(sum(t.get("used", 0) for t in (pool.get("tiers") or {}).values())),
        "indexed_blocks": float(int(pool.get("cached_tokens") or 0) // page),
        "protected_pages": float(pool.get("protected_pages") or 0),
        "running": float(states.get("num_reqs") or 0),
        "waiting": float(states.get("num_waiting_reqs") or 0),
    }
    return out | picked(
        metrics,
        evicted_blocks="memserve:evicted_blocks_total",
        requests="sglang:num_requests_total",
        aborted="sglang:num_aborted_requests_total",
        cached_tokens="sglang:cached_tokens_total",
    )


def gauges_of(proc: Proc) -> dict[str, float]:
    try:
        with urllib.request.urlopen(proc.url + "/get_server_info", timeout=GAUGE_TIMEOUT_S) as r:
            info = json.load(r)
    except (OSError, ValueError):
        return {}
    if not info or not isinstance(info, dict):
        return {}
    gauges = router_gauges if proc.role == "router" else worker_gauges
    return gauges(info, scrape(proc.url + "/metrics"))


@dataclass
class Sampler:
    """Samples `procs` every `every_s` seconds into `samples` until stopped, then once more."""

    procs: list[Proc]
    every_s: float
    origin: float  # time.perf_counter() at the load's start
    samples: list[Sample] = field(default_factory=list)
    exited: dict[str, float] = field(default_factory=dict)  # name -> when it was first missing

    async def sample(self) -> Sample:
        t = time.perf_counter() - self.origin
        rss: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for proc in self.procs:
            mib = rss_mib(proc.pid)
            if mib is None:
                self.exited.setdefault(proc.name, t)
                continue
            rss[proc.name], cpu[proc.name] = mib, cpu_seconds(proc.pid)
            for kid in children(proc.pid):
                if (kid_mib := rss_mib(kid)) is not None:
                    name = f"{proc.name}/{kid} {comm(kid)}"
                    rss[name], cpu[name] = kid_mib, cpu_seconds(kid)
        found = await asyncio.gather(*(asyncio.to_thread(gauges_of, p) for p in self.procs))
        gauges = {p.name: g for p, g in zip(self.procs, found, strict=True) if g}
        self.samples.append(sample := Sample(t, rss, cpu, gauges))
        return sample

    async def run(self, stop: asyncio.Event, on_sample: Callable[[Sample], None]) -> None:
        while not stop.is_set():
            sample = await self.sample()
            on_sample(sample)
            next_at = self.origin + sample.t + self.every_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.perf_counter()))
        await self.sample()  # the last one, once the load has stopped


@dataclass
class Running:
    cluster: Cluster
    router: RunningRouter

    def procs(self) -> list[Proc]:
        out = [Proc("router", self.router.server.proc.pid, "router", self.router.url)]
        for w in self.cluster.workers:
            assert w.pid is not None
            out.append(Proc(w.name, w.pid, w.role, w.url))
        return out

    def servers(self) -> dict[str, Server]:
        """The router and every worker, by the name they are reported under."""
        out = {"router": self.router.server}
        return out | {w.name: w.server for w in self.cluster.workers if w.server is not None}

    def stop(self) -> None:
        self.router.server.stop()
        self.cluster.stop()


def start(spec: ClusterSpec, model_dir: Path, log_dir: Path) -> Running:
    """Workers first (in parallel), then the router once a chat goes through it; whatever
    started is stopped again if something does not come up."""
    cluster = Cluster.create(spec, model_dir, log_dir, None)
    cluster.start()
    try:
        model = served_model(cluster.workers[0].url)
        return Running(cluster, start_router(RouterSpec(OURS, POLICY), cluster, log_dir, model))
    except BaseException:
        cluster.stop()
        raise


def mempool_accounting(
    cluster: Cluster, timeout_s: float = SETTLE_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Per worker, once the load has stopped: blocks used vs indexed and pinned pages (the
    tests' `no_leak`), polled until they balance (a PD write-back or an abort's cleanup may
    still be under way) or `timeout_s` passes; `settle_s`: when they did (or the last poll)."""
    begun = time.monotonic()
    rows: dict[str, dict[str, Any]] = {}
    while True:
        for w, info in zip(cluster.workers, cluster.server_info(), strict=True):
            if rows.get(w.name, {}).get("balanced"):
                continue
            g = worker_gauges(info, {}) if info else {}
            balanced = bool(g) and g["used_blocks"] == g["indexed_blocks"]
            balanced = balanced and g["running"] == g["waiting"] == g["protected_pages"] == 0
            rows[w.name] = {
                "worker": w.name,
                "role": w.role,
                "reachable": bool(g),
                **{key: g.get(key) for key in ACCOUNTED},
                "balanced": balanced,
                "settle_s": round(time.monotonic() - begun, 2),
            }
        if all(r["balanced"] for r in rows.values()) or time.monotonic() - begun > timeout_s:
            return list(rows.values())
        time.sleep(0.25)
