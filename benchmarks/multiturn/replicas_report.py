"""Two router replicas against one router: the figures issue #11 asks for, per workload.

Runs of `ours prompt_tree` and `ours prompt_tree xN replicas` on the same workload and seed
are paired: the hit ratio's difference in points (the issue expects the replicas within 5
points of the single router) and ratio, TTFT p50/p99 and throughput side by side; over
several seeds the median and the min..max. The propagation delay is each replicated run's
lag histogram (another replica's op applied, minus its publication), and the front's cost
comes from its calibration at the start of each replicated run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness import finite
from benchmarks.report import seeds
from benchmarks.report.table import markdown_table, percent, rounded, table_section

SINGLE = "ours prompt_tree"
HIT_GAP_POINTS = 5.0  # the issue: the replicas' hit ratio within this many points of one router


PROCESS_GAP_POINTS = 2.0  # --processes N: hit ratio within this many points of one process


def replicated(run: dict[str, Any]) -> bool:
    name = str(run.get("system", ""))
    return name.startswith(f"{SINGLE} x") and name.endswith(" replicas")


def several_processes(run: dict[str, Any]) -> bool:
    """`ours prompt_tree xN processes`: one router of N processes (--processes N)."""
    name = str(run.get("system", ""))
    return name.startswith(f"{SINGLE} x") and name.endswith(" processes")


def pairs(
    runs: Sequence[dict[str, Any]], which: Callable[[dict[str, Any]], bool] = replicated
) -> dict[str, list[tuple[dict[str, Any], ...]]]:
    """workload -> [(single, replicated), ...], one pair per seed, main runs that ran
    (`which`: the runs paired with the single router's)."""
    out: dict[str, list[tuple[dict[str, Any], ...]]] = {}
    main = [r for r in runs if r.get("group") == "main" and r.get("available")]
    for rep in (r for r in main if which(r)):
        single = next(
            (
                r
                for r in main
                if r["system"] == SINGLE
                and r["workload"] == rep["workload"]
                and r.get("seed") == rep.get("seed")
            ),
            None,
        )
        if single is not None:
            out.setdefault(rep["workload"], []).append((single, rep))
    return out


def spread(values: Sequence[Any]) -> dict[str, Any]:
    """Median, min and max of the finite values (None when there are none), and how many."""
    xs = [v for v in values if finite(v)]
    return {**(seeds.spread(xs) or dict.fromkeys(("median", "min", "max"))), "n": len(xs)}


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For results.json: per workload the paired hit ratios, latencies, propagation delay and
    front overhead, each with its spread over seeds."""
    out: dict[str, Any] = {}
    for workload, found in pairs(runs).items():
        per_seed = []
        for single, rep in found:
            hit_1, hit_n = single.get("hit_ratio"), rep.get("hit_ratio")
            gap = ratio = None
            if finite(hit_1) and finite(hit_n):
                gap, ratio = (hit_n - hit_1) * 100, (hit_n / hit_1 if hit_1 else None)
            prop = rep.get("propagation") or {}
            calibration = rep.get("front_overhead") or {}
            per_seed.append(
                {
                    "seed": rep.get("seed"),
                    "system": rep["system"],
                    "hit_single": hit_1,
                    "hit_replicas": hit_n,
                    "hit_gap_points": gap,
                    "hit_ratio_vs_single": ratio,
                    **{
                        f"{k}_{who}": r.get(k)
                        for who, r in (("single", single), ("replicas", rep))
                        for k in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s")
                    },
                    "lag_count": prop.get("count"),
                    "lag_p50_s": prop.get("p50_s"),
                    "lag_p99_s": prop.get("p99_s"),
                    "lag_mean_s": prop.get("mean_s"),
                    "ops_dropped": prop.get("dropped"),
                    "front_added_p50_ms": (calibration.get("liveness") or {}).get("added_p50_ms"),
                    "front_chat_added_p50_ms": (calibration.get("chat_stream") or {}).get(
                        "added_p50_ms"
                    ),
                }
            )
        gaps = [p["hit_gap_points"] for p in per_seed]
        out[workload] = {
            "per_seed": per_seed,
            **{
                key: spread([p[key] for p in per_seed])
                for key in (
                    "hit_gap_points",
                    "hit_ratio_vs_single",
                    "lag_p50_s",
                    "lag_p99_s",
                    "front_added_p50_ms",
                    "front_chat_added_p50_ms",
                )
            },
            "within_5_points": sum(1 for g in gaps if finite(g) and abs(g) <= HIT_GAP_POINTS),
            "seeds": len(per_seed),
        }
    return out


def _ms(seconds: Any) -> Any:
    return round(seconds * 1e3, 2) if finite(seconds) else None


def _range(s: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    scaled = {k: s[k] * scale for k in ("median", "min", "max")} if s.get("n") else None
    return seeds.spread_text(scaled, parens=True, spec=fmt) or "?"


def sections(figures: dict[str, Any]) -> list[str]:
    """The Markdown section: one paired table per workload, then a line of medians."""
    if not figures:
        return []
    out = [
        "## Router replicas: two replicas behind a round-robin front vs one router",
        "",
        "Paired runs (same workload, same seed, same workers). `gap`: the replicas' hit ratio "
        "minus the single router's, in points (issue #11 expects |gap| <= 5). `lag`: another "
        "replica's op applied minus its publication (`memserve_router_replica_lag_seconds`, "
        "both replicas pooled, quantiles interpolated in the histogram's buckets). `front`: "
        "the front's added latency from its calibration (median through the front minus "
        "median straight to a replica; GET /liveness, and a streamed 2-token chat).",
        "",
    ]
    for workload, w in figures.items():
        rows = []
        for p in w["per_seed"]:
            rows.append(
                {
                    "seed": p["seed"] if p["seed"] is not None else "-",
                    "hit 1 router": percent(p["hit_single"], 1),
                    "hit replicas": percent(p["hit_replicas"], 1),
                    "gap (points)": rounded(p["hit_gap_points"], 1),
                    "TTFT p50 1 / 2": f"{rounded(p['ttft_p50_s_single'])} / "
                    f"{rounded(p['ttft_p50_s_replicas'])}",
                    "TTFT p99 1 / 2": f"{rounded(p['ttft_p99_s_single'])} / "
                    f"{rounded(p['ttft_p99_s_replicas'])}",
                    "tok/s 1 / 2": f"{rounded(p['output_tokens_per_s_single'], 0)} / "
                    f"{rounded(p['output_tokens_per_s_replicas'], 0)}",
                    "lag p50 ms": _ms(p["lag_p50_s"]),
                    "lag p99 ms": _ms(p["lag_p99_s"]),
                    "lag ops": rounded(p["lag_count"], 0),
                    "front ms": rounded(p["front_added_p50_ms"], 2),
                    "front chat ms": rounded(p["front_chat_added_p50_ms"], 2),
                }
            )
        out += [f"### {workload}", "", markdown_table(rows), ""]
        seeds = f"median (min..max) over {w['seeds']} seeds" if w["seeds"] > 1 else "one seed"
        out += [
            f"{seeds}: gap {_range(w['hit_gap_points'], '+.1f')} points, hit ratio "
            f"{_range(w['hit_ratio_vs_single'], '.3f')}x the single router's, within 5 points "
            f"in {w['within_5_points']} of {w['seeds']}; propagation delay p50 "
            f"{_range(w['lag_p50_s'], '.2f', 1e3)} ms, p99 {_range(w['lag_p99_s'], '.2f', 1e3)} "
            f"ms; the front adds {_range(w['front_added_p50_ms'], '.2f')} ms to a round trip "
            f"and {_range(w['front_chat_added_p50_ms'], '.2f')} ms to a streamed chat.",
            "",
        ]
    return out


def processes_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For results.json: per workload and seed, the hit ratio of one router process and of
    N (`--processes N`), and the gap in points."""
    out: dict[str, Any] = {}
    for workload, found in pairs(runs, several_processes).items():
        rows = []
        for single, many in found:
            hit_1, hit_n = single.get("hit_ratio"), many.get("hit_ratio")
            gap = (hit_n - hit_1) * 100 if finite(hit_1) and finite(hit_n) else None
            rows.append(
                {
                    "seed": many.get("seed"),
                    "system": many["system"],
                    "hit_single": hit_1,
                    "hit_processes": hit_n,
                    "hit_gap_points": gap,
                    "within": None if gap is None else abs(gap) <= PROCESS_GAP_POINTS,
                }
            )
        out[workload] = rows
    return out


def processes_sections(figures: dict[str, Any]) -> list[str]:
    """The Markdown section for `processes_summary`."""
    if not figures:
        return []
    rows = [
        {
            "workload": workload,
            "seed": p["seed"] if p["seed"] is not None else "-",
            "system": p["system"],
            "hit 1 process": percent(p["hit_single"], 1),
            "hit N processes": percent(p["hit_processes"], 1),
            "gap (points)": rounded(p["hit_gap_points"], 1),
            f"within {PROCESS_GAP_POINTS:g} points": p["within"],
        }
        for workload, found in figures.items()
        for p in found
    ]
    return table_section(
        "Router processes: one router of N processes (--processes N) vs one process",
        rows,
        "Paired runs (same workload, same seed, same workers); the processes share one state "
        "over a local channel and the kernel spreads the clients' connections over them.",
    )
