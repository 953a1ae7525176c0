"""One run: a fresh router of one system in front of the cluster, one step's requests sent
open loop (never retried), the figures of module `slo` and the workers' retractions."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress

from benchmarks.harness import run_async
from benchmarks.load.causal import run_workload
from benchmarks.load.record import Record
from benchmarks.load.retry import NO_RETRY
from benchmarks.multiturn.cluster import RouterSpec, start_router
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.workloads import Workload
from benchmarks.overload.slo import OK, Sample, figures, longest_waits, status_of
from localrun.cluster import Cluster, scrape


@dataclass
class Bench:
    """What every run shares: the workers, their model and floor, logs and progress bars."""

    cluster: Cluster
    model: str
    floor: Floor
    log_dir: Path
    progress: Progress


def samples_of(outcomes: Sequence[Record], floors: Sequence[float], floor: Floor) -> list[Sample]:
    """The client's outcomes as the figures' samples (by rid, floors in rid order)."""
    out = []
    for o in outcomes:
        status = status_of(o.outcome)
        own = None
        if status == OK and o.prompt_tokens:
            own = floor.ttft_s(o.prompt_tokens, o.cached_tokens)
        end = None if o.sent_s is None or o.e2e_s is None or status != OK else o.sent_s + o.e2e_s
        timing = (o.sent_s, o.ttft_s, end, floors[o.rid], own)
        out.append(Sample(status, *timing, o.prompt_tokens, o.cached_tokens))
    return out


def run_one(
    bench: Bench,
    system: RouterSpec,
    workload: Workload,
    floors: Sequence[float],
    deadline_s: float,
    label: str,
) -> dict[str, Any]:
    """Start `system`, send `workload`, stop it; the run's record (RuntimeError when the
    router does not come up)."""
    cluster = bench.cluster
    cluster.flush()
    router = start_router(system, cluster, bench.log_dir, bench.model)
    cluster.flush()  # the start-up probe must not warm anyone's cache
    task = bench.progress.add_task(label, total=len(workload.requests))
    bench.progress.refresh()
    last = [0.0]

    def on_done(_: Record) -> None:
        bench.progress.advance(task)
        if (now := time.monotonic()) - last[0] > 0.5:
            last[0] = now
            bench.progress.refresh()

    before, busy_before = cluster.worker_counters(), cluster.busy_seconds()
    try:
        sending = run_workload(router.url, workload, bench.model, on_done, retry=NO_RETRY)
        result = run_async(sending)  # open loop: no request has a parent to wait for
        metrics = scrape(router.url + "/metrics") if router.routers else {}
    finally:
        router.stop()
        bench.progress.remove_task(task)
        bench.progress.refresh()
    after = cluster.worker_counters()
    busy = sum(cluster.busy_seconds()) - sum(busy_before)
    samples = samples_of(result.records, floors, bench.floor)
    record: dict[str, Any] = {
        "system": system.name,
        "router": system.router,
        "policy": system.policy,
        "rate": workload.params["rate"],
        "seed": workload.params["seed"],
        **figures(samples, deadline_s),
        "longest_waits": longest_waits(samples),
        "error_samples": sorted({p for o in result.records if (p := o.problem)})[:3],
        "router_admission": admission(metrics),
        # our trees' predicted cached tokens against what the workers reported: a queue
        # estimate counts only the tokens it expects a worker to compute
        "router_predicted_cached": metrics.get("memserve_router_predicted_cached_tokens_total"),
        "router_reported_cached": metrics.get("memserve_router_reported_cached_tokens_total"),
        "retracted": delta(before, after, "retracted"),
        "engine_aborts": delta(before, after, "aborted"),
        # the workers' modelled GPU seconds in wall time: what the queue estimate is against
        "busy_s": busy * cluster.time_scale,
        "wall_s": result.wall_s,
        # the machine's 1-minute load at the end: above its cores, something else competed
        "loadavg_1m": os.getloadavg()[0],
    }
    return record


def delta(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]], key: str) -> float:
    """A worker counter's growth over the run, summed over the workers."""
    return sum(a.get(key, 0.0) - b.get(key, 0.0) for b, a in zip(before, after, strict=True))


def admission(metrics: dict[str, float]) -> dict[str, float] | None:
    """Our router's admission holds and refusals by reason (None for a peer)."""
    if not metrics:
        return None
    out: dict[str, float] = {}
    for name, value in metrics.items():
        for kind in ("holds", "refusals"):
            prefix = f"memserve_router_admission_{kind}_total{{"
            if name.startswith(prefix) and value:
                reason = name.split('reason="', 1)[1].split('"', 1)[0]
                out[f"{kind}:{reason}"] = value
    return out
