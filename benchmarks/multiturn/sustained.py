"""The rate a cluster sustains, measured on its own workers before the measured runs.

A comparison at "85 % load" needs the load's 100 %. It is measured, not assumed: on the
started cluster, one reference system (a preset names it, a peer so that the figure does
not move when our router changes) serves a short calibration workload at rising offered
rates; at each, completed requests per second of the active span (the first send to the
last answer: `throughput_rps`) are read. That span carries one request's latency more than
the sending does, so a run that keeps up reads a little under its rate (a few % at 120
requests); the span between the first and the last answer would not, but an overloaded
engine that prefills its queue side by side answers it in a burst at the end, and that span
then reads several times the rate it really served. The search starts at a fraction of the
floor model's bound and multiplies the rate by `factor` each step; a cluster already behind
(completed/s below `behind` x the rate the client really sent at) is next offered `retreat`
x what it served, until it keeps up. Once it kept up at one rate, the search stops when it
falls behind, when completed/s grew less than `min_growth` over the best so far, or after
`max_steps`. The sustained
rate is the most completed/s seen: past it, caches thrash and the rate served falls. The
floor model's bound (every prefill worker busy all the time on the oracle's uncached tokens,
nothing else) is recorded next to it: an upper bound the measurement must stay under.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.cluster import RouterSpec
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.oracle import Replay
from localrun.cluster import Cluster


def at_rate(builder: Any, rate: float) -> Any:
    """The builder offering `rate` requests/s (its `qps` or its `rate`)."""
    if hasattr(builder, "qps"):
        return replace(builder, qps=rate)
    return replace(builder, rate=rate)


def floor_bound_rps(floor: Floor, planned: Replay, prefill_workers: int) -> float | None:
    """Requests/s the prefill workers could finish if each request cost only its floor
    TTFT (the oracle's hits, alone, no decode): an upper bound on the sustained rate."""
    ttfts = [
        floor.ttft_s(n, hit or 0)
        for n, hit in zip(planned.lengths, planned.hits, strict=True)
        if n is not None
    ]
    mean = statistics.fmean(ttfts) if ttfts else 0.0
    return prefill_workers / mean if mean > 0 else None


@dataclass(frozen=True)
class Search:
    """How the sustained rate is searched for."""

    start_fraction: float = 0.35  # of the floor model's bound
    factor: float = 1.4
    min_growth: float = 0.08
    behind: float = 0.8
    retreat: float = 0.9  # behind from the start: next offer this x what it served
    max_steps: int = 6

    def describe(self) -> str:
        """The search in one sentence, for the reports."""
        return (
            f"the rate starts at {self.start_fraction:.0%} of the floor model's bound and "
            f"rises {self.factor:g}x a step (a cluster behind from the start is next offered "
            f"{self.retreat:.0%} of what it served) until, having kept up once, the cluster "
            f"falls behind (completed/s from the first send to the last answer below "
            f"{self.behind:.0%} of the rate really sent) or its completed/s grow less than "
            f"{self.min_growth:.0%}, at most {self.max_steps} steps; the most completed/s seen "
            "is the sustained rate"
        )


@dataclass
class Calibration:
    """One cluster's measured sustained rate and the steps that found it."""

    reference: str  # the system that served the calibration workload
    cluster: str
    floor_bound_rps: float | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    sustained_rps: float | None = None
    stopped: str = ""  # why the search ended

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


RunAt = Callable[[float], dict[str, Any]]  # offered rate -> the run's record


def search(run_at: RunAt, bound: float | None, first_rate: float, how: Search) -> Calibration:
    """Raise the offered rate from `first_rate` until completed requests/s stop growing;
    `run_at(rate)` runs the calibration workload at that rate and returns its record. A
    cluster behind at its first rates (the floor's bound counts prefill only, and a single
    decode can be the limit) is next offered `retreat` x what it served, until it keeps up."""
    cal = Calibration("", "", bound)
    rate, best, kept_up = first_rate, 0.0, False
    for _ in range(how.max_steps):
        record = run_at(rate)
        done, sent = record.get("throughput_rps"), record.get("offered_rps")
        cal.steps.append(
            {
                "offered_rps": rate,
                "sent_rps": sent,
                "completed_rps": done,
                "errors": record.get("errors"),
                "ttft_p50_s": record.get("ttft_p50_s"),
                "ttft_p99_s": record.get("ttft_p99_s"),
                "hit_ratio": record.get("reuse_ratio", record.get("hit_ratio")),
                "gpu_utilization": record.get("gpu_utilization"),
                "loadavg_1m": record.get("loadavg_1m"),
                "cpu_s": record.get("cpu_s"),
                "wall_s": record.get("wall_s"),
            }
        )
        if not record.get("available", True):
            cal.stopped = f"the reference did not run: {record.get('reason')}"
            break
        if record.get("errors") or not finite(done):
            cal.stopped = f"errors at {rate:.3g} req/s offered: {record.get('error_samples')}"
            break
        sent = sent if finite(sent) else rate
        behind = done < how.behind * sent
        grew = done >= (1 + how.min_growth) * best
        best = max(best, done)
        if kept_up and behind:
            cal.stopped = f"the cluster fell behind: {done:.3g} completed/s, {sent:.3g} sent/s"
            break
        if kept_up and not grew:
            cal.stopped = f"completed/s stopped growing: {done:.3g} at {rate:.3g} offered"
            break
        if behind:  # overloaded from the start: offer a little less than it served
            rate = how.retreat * done
            continue
        kept_up = True
        rate *= how.factor
    else:
        cal.stopped = f"{how.max_steps} steps without both keeping up and falling behind"
    cal.sustained_rps = best or None
    return cal


def calibrate(
    cluster: Cluster,
    reference: RouterSpec,
    run_at: RunAt,
    floor: Floor,
    planned: Replay,
    how: Search = Search(),
) -> Calibration:
    """The sustained rate of `cluster` with `reference` routing the calibration workload."""
    prefills = len(cluster.by_role("prefill")) or len(cluster.by_role("colocated"))
    bound = floor_bound_rps(floor, planned, prefills)
    first = how.start_fraction * bound if bound else 1.0
    cal = search(run_at, bound, first, how)
    cal.reference, cal.cluster = reference.name, cluster.spec.name
    if cal.sustained_rps and bound and cal.sustained_rps > bound:
        cal.stopped += "; above the floor model's bound, which no cluster can serve: suspect"
    return cal
