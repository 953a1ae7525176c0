"""Every few seconds: each process's RSS and CPU time, and the router's and workers' gauges.

RSS is VmRSS from /proc/PID/status (what the kernel counts as resident, shared pages
included), for each process we started and every descendant it has (found through
/proc/PID/task/*/children), each its own series: a leak in a helper process shows apart
from its parent. Gauges come over HTTP (/get_server_info, /metrics) with a short timeout; a
gauge that could not be read is missing from that sample, not zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import children, rss_mib
from localrun.cluster import cpu_seconds, scrape

GAUGE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Proc:
    """A process to watch: the name it is reported under, its pid and its HTTP base URL."""

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


async def get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with http.get(url) as resp:
            if resp.status != 200:
                return {}
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


async def gauges_of(http: aiohttp.ClientSession, proc: Proc) -> dict[str, float]:
    info = await get_json(http, proc.url + "/get_server_info")
    if not info:
        return {}
    metrics = await asyncio.to_thread(scrape, proc.url + "/metrics")
    if proc.role == "router":
        return router_gauges(info, metrics)
    return worker_gauges(info, metrics)


@dataclass
class Sampler:
    """Samples `procs` every `every_s` seconds into `samples` until stopped."""

    procs: list[Proc]
    every_s: float
    origin: float  # time.perf_counter() at the load's start
    samples: list[Sample] = field(default_factory=list)
    exited: dict[str, float] = field(default_factory=dict)  # name -> when it was first missing

    async def sample(self, http: aiohttp.ClientSession) -> Sample:
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
                kid_mib = rss_mib(kid)
                if kid_mib is not None:
                    name = f"{proc.name}/{kid} {comm(kid)}"
                    rss[name], cpu[name] = kid_mib, cpu_seconds(kid)
        found = await asyncio.gather(*(gauges_of(http, p) for p in self.procs))
        gauges = {p.name: g for p, g in zip(self.procs, found, strict=True) if g}
        sample = Sample(t, rss, cpu, gauges)
        self.samples.append(sample)
        return sample

    async def run(
        self, stop: asyncio.Event, on_sample: Callable[[Sample], None] | None = None
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=GAUGE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                sample = await self.sample(http)
                if on_sample is not None:
                    on_sample(sample)
                next_at = self.origin + sample.t + self.every_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.perf_counter()))
                if stop.is_set():
                    await self.sample(http)  # the last one, once the load has stopped
                    return
