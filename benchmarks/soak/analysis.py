"""From records and samples to figures: outcomes by kind, latency per window, RSS slopes."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import percentile
from benchmarks.load.record import EXPECTED, Record
from benchmarks.soak.cluster import Proc, Sample

MAX_ERRORS_KEPT = 50


def ms(seconds: Sequence[float], q: float) -> float | None:
    value = percentile(seconds, q)
    return None if math.isnan(value) else round(value * 1000, 2)


def latency(records: Sequence[Record]) -> dict[str, Any]:
    """End to end of every complete answer; TTFT of complete streams."""
    done = [r for r in records if r.outcome == "ok" and r.e2e_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    ttft = [r.ttft_s for r in done if r.stream and r.ttft_s is not None]
    return {
        "answers": len(done),
        "errors": sum(1 for r in records if r.failed),
        "e2e_p50_ms": ms(e2e, 0.5),
        "e2e_p99_ms": ms(e2e, 0.99),
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p99_ms": ms(ttft, 0.99),
    }


def windows(records: Sequence[Record], window_s: float, duration_s: float) -> list[dict[str, Any]]:
    """Latency per window of request start times."""
    count = max(1, math.ceil(duration_s / window_s))
    buckets: list[list[Record]] = [[] for _ in range(count)]
    for r in records:
        buckets[min(count - 1, int((r.sent_s or 0.0) // window_s))].append(r)
    return [
        {
            "t0_s": round(i * window_s, 1),
            "t1_s": round(min((i + 1) * window_s, duration_s), 1),
            "requests": len(bucket),
            **latency(bucket),
        }
        for i, bucket in enumerate(buckets)
    ]


def outcomes(records: Sequence[Record]) -> list[dict[str, Any]]:
    counts = Counter(r.outcome for r in records)
    return [
        {"outcome": kind, "count": n, "expected": kind in EXPECTED}
        for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def error_list(records: Sequence[Record]) -> list[dict[str, Any]]:
    """The unexpected errors (the first MAX_ERRORS_KEPT), each with its status and body."""
    return [
        {"t": r.sent_s, "api": r.path}
        | {k: getattr(r, k) for k in ("stream", "kind", "session", "turn", "outcome", "status")}
        | {"body": r.detail}
        for r in [r for r in records if r.failed][:MAX_ERRORS_KEPT]
    ]


def mix(records: Sequence[Record]) -> dict[str, int]:
    counts = Counter(
        "bad" if r.kind == "bad" else f"{r.path} {'stream' if r.stream else 'whole'}"
        for r in records
    )
    return dict(sorted(counts.items()))


def cache_share(records: Sequence[Record]) -> float | None:
    """Cached share of prompt tokens over the complete answers (0 where not reported)."""
    pairs = [(r.prompt_tokens, r.cached_tokens) for r in records if r.ok]
    total = sum(p for p, _ in pairs)
    return round(sum(c for _, c in pairs) / total, 4) if total else None


def prediction(gauges_end: dict[str, dict[str, float]]) -> dict[str, float | None] | None:
    """The router's prefix trees against the engines at the end of the run: cached tokens
    predicted and reported over the answers that reported theirs (router.accuracy), and
    their ratio. None if the router's metrics were not read."""
    for gauges in gauges_end.values():
        predicted = gauges.get("predicted_cached_tokens")
        reported = gauges.get("reported_cached_tokens")
        if predicted is not None and reported is not None:
            ratio = round(predicted / reported, 4) if reported else None
            return {"predicted": predicted, "reported": reported, "ratio": ratio}
    return None


def series(samples: Sequence[Sample]) -> dict[str, list[list[float]]]:
    """Process name -> [[t, MiB], ...]."""
    out: dict[str, list[list[float]]] = {}
    for s in samples:
        for name, mib in s.rss_mib.items():
            out.setdefault(name, []).append([round(s.t, 2), round(mib, 2)])
    return out


def gauge_series(samples: Sequence[Sample]) -> dict[str, dict[str, list[list[float]]]]:
    """Process name -> gauge -> [[t, value], ...]."""
    out: dict[str, dict[str, list[list[float]]]] = {}
    for s in samples:
        for name, gauges in s.gauges.items():
            for gauge, value in gauges.items():
                out.setdefault(name, {}).setdefault(gauge, []).append([round(s.t, 2), value])
    return out


def slope_mib_per_min(points: Sequence[Sequence[float]]) -> float | None:
    """Least-squares slope of RSS against time, MiB per minute; None for under 3 points."""
    if len(points) < 3:
        return None
    xs = [p[0] / 60 for p in points]
    ys = [p[1] for p in points]
    if max(xs) - min(xs) <= 0:
        return None
    return round(statistics.linear_regression(xs, ys).slope, 3)


def memory(
    samples: Sequence[Sample], procs: Sequence[Proc], warmup_s: float, threshold: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per process: RSS first, at warm-up end (its first sample at or after it, else its
    last), at the end, its peak, and the slope fitted after warm-up; the verdict over all."""
    roles = {p.name: p.role for p in procs}
    cpu = {name: s for sample in samples for name, s in sample.cpu_s.items()}  # the last
    rows = []
    for name, points in series(samples).items():
        slope = slope_mib_per_min([p for p in points if p[0] >= warmup_s])
        warm = next((p[1] for p in points if p[0] >= warmup_s), points[-1][1])
        end = points[-1][1]
        rows.append(
            {
                "process": name,
                "role": roles.get(name, "child"),
                "samples": len(points),
                "rss_first_mib": points[0][1],
                "rss_warmup_end_mib": warm,
                "rss_end_mib": end,
                "rss_max_mib": max(p[1] for p in points),
                "growth_after_warmup_mib": round(end - warm, 2),
                "slope_mib_per_min": slope,
                "flat": None if slope is None else slope <= threshold,
                "cpu_s": round(cpu.get(name, 0.0), 2),
            }
        )
    judged = [r for r in rows if r["flat"] is not None]
    verdict = {
        "memory_flat": bool(judged) and all(r["flat"] for r in judged),
        "judged_processes": len(judged),
        "threshold_mib_per_min": threshold,
        "warmup_s": warmup_s,
        "fit": "least squares of VmRSS against time over the samples after warm-up",
    }
    return rows, verdict


def p99_range(rows: Sequence[dict[str, Any]], key: str) -> list[float] | None:
    values = [r[key] for r in rows if r[key] is not None]
    return [min(values), max(values)] if values else None
