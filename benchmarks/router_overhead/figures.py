"""Per-system figures from the raw samples: latency, added latency (plain and paired with
the baseline's same request), cache hits, and the max-rps ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import percentile
from benchmarks.router_overhead.settings import WORKLOADS
from benchmarks.router_overhead.systems import System


def p50_p99(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    return {"p50": percentile(samples, 0.5) * scale, "p99": percentile(samples, 0.99) * scale}


def system_figures(system: System, baseline: System) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": system.name,
        "kind": system.kind,
        "router": system.router,
        "policy": system.policy,
        "available": system.available,
        "reason": system.reason,
        "latency_ms": {},
        "added_ms": {},
        "added_paired_ms": {},
        "requests": {},
        "errors": {},
        "worker_cached_fraction": {},
        "rps": system.rps,
    }
    if not system.available:
        return out
    for w in WORKLOADS:
        mine, theirs = system.samples.get(w, []), baseline.samples.get(w, [])
        samples = [x for x in mine if x is not None]
        out["requests"][w] = len(samples)
        out["errors"][w] = system.errors.get(w, 0)
        lat = p50_p99(samples, 1e3)
        base = p50_p99([x for x in theirs if x is not None], 1e3)
        out["latency_ms"][w] = lat
        out["added_ms"][w] = {q: lat[q] - base[q] for q in ("p50", "p99")}
        pairs = [
            a - b for a, b in zip(mine, theirs, strict=False) if a is not None and b is not None
        ]
        out["added_paired_ms"][w] = p50_p99(pairs, 1e3)
        cached = system.cached.get(w)
        out["worker_cached_fraction"][w] = statistics.fmean(cached) if cached else None
    return out


def rps_ratios(fig: dict[str, Any]) -> dict[str, float | None]:
    by_name = {s["name"]: s for s in fig["systems"]}

    def rps(name: str) -> float | None:
        s = by_name[name]
        return s["rps"]["rps"] if s["available"] and s["rps"] else None

    out = {}
    for ours, peer in (
        ("ours prompt_tree", "sglang-router cache_aware"),
        ("ours round_robin", "sglang-router round_robin"),
    ):
        a, b = rps(ours), rps(peer)
        out[f"{ours} / {peer}"] = a / b if a and b else None
    return out
