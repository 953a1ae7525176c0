"""Per-system figures from the raw samples: latency, added latency (plain and paired with
the baseline's same request), cache hits, and the max-rps ratios."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
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
        "cores": system.cores,
        "processes": system.processes,
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


def _rps(s: dict[str, Any] | None) -> float | None:
    return s["rps"]["rps"] if s and s["available"] and s["rps"] else None


def headline(fig: dict[str, Any], cores: int | None = None) -> dict[str, Any]:
    """Ours prompt_tree with a process per core, on `cores` (default: the largest set)."""
    cores = cores or max(fig["core_counts"])
    return next(
        s
        for s in fig["systems"]
        if s["kind"] == "ours"
        and s["policy"] == "prompt_tree"
        and s["cores"] == cores
        and s["processes"] == cores
    )


def peer_on(fig: dict[str, Any], router: str, policy: str, cores: int) -> dict[str, Any] | None:
    return next(
        (
            s
            for s in fig["systems"]
            if s["router"] == router and s["policy"] == policy and s["cores"] == cores
        ),
        None,
    )


def rps_ratios(fig: dict[str, Any]) -> dict[str, float | None]:
    """Ours / the peers' max rps on the same CPU set."""
    out: dict[str, float | None] = {}
    for cores in fig["core_counts"]:
        ours = [s for s in fig["systems"] if s["kind"] == "ours" and s["cores"] == cores]
        for mine in ours:
            policy = "cache_aware" if mine["policy"] == "prompt_tree" else mine["policy"]
            for peer in ("sglang-router", "smg"):
                theirs = peer_on(fig, peer, policy, cores)
                if theirs is None:
                    continue
                a, b = _rps(mine), _rps(theirs)
                out[f"{mine['name']} / {theirs['name']}"] = a / b if a and b else None
    return out


def scaling(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """Per router: max rps on each CPU set, per core, and from the smallest set to the
    largest (ours with a process per core: 1 process on 1 core, N on N)."""
    counts = fig["core_counts"]

    def ours(processes: int | None) -> Callable[[dict[str, Any], int], bool]:
        """Ours prompt_tree with `processes` processes (None: one per core)."""
        return lambda s, c: (
            s["kind"] == "ours"
            and s["policy"] == "prompt_tree"
            and s["processes"] == (processes or c)
        )

    def peer(router: str) -> Callable[[dict[str, Any], int], bool]:
        return lambda s, c: s["router"] == router and s["policy"] == "cache_aware"

    families = [
        ("ours prompt_tree, a process per core", ours(None)),
        ("ours prompt_tree, 1 process", ours(1)),
        ("sglang-router cache_aware", peer("sglang-router")),
        ("smg cache_aware", peer("smg")),
    ]
    rows = []
    for label, member in families:
        row: dict[str, Any] = {"router": label}
        rps = {}
        for c in counts:
            s = next((x for x in fig["systems"] if x["cores"] == c and member(x, c)), None)
            rps[c] = _rps(s)
            row[f"rps @{c}c"] = rps[c]
            row[f"rps per core @{c}c"] = rps[c] / c if rps[c] else None
        lo, hi = min(counts), max(counts)
        low, high = rps[lo], rps[hi]
        row[f"scaling {lo}c -> {hi}c"] = high / low if hi != lo and high and low else None
        rows.append(row)
    return rows


def router_cpu_us(s: dict[str, Any] | None) -> float | None:
    """The router's own CPU per request completed in its max-rps windows (µs)."""
    value = ((s or {}).get("rps") or {}).get("router_cpu_us_per_request")
    return float(value) if value else None


def cpu_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """Per router: its own CPU per request at max rps, the cores it kept busy, and both
    against sglang-router cache_aware's on the same set. The client and the workers share
    the machine, so max rps is the whole box's; CPU per request is the router's alone."""
    rows = []
    for s in fig["systems"]:
        mine = router_cpu_us(s)
        if s["kind"] == "baseline" or not s["available"] or mine is None:
            continue
        peer = router_cpu_us(peer_on(fig, "sglang-router", "cache_aware", s["cores"]))
        rps = s["rps"]
        rows.append(
            {
                "system": s["name"],
                "router CPU us/request": mine,
                "router cores busy": rps["router_cpu_s"] / rps["duration_s"],
                "x sglang-router cache_aware's": mine / peer if peer else None,
                "rps one core would serve": 1e6 / mine,
            }
        )
    return rows
