"""The capacity preset's part of its paired report (`paired_report.write_paired`): the
targets at 4x working set, the paired ratios of every system, the sizing and the plots.

A config is one (workload, working-set multiple, host tier) cluster. Ratios between two
systems are taken within a seed (the same requests, the same workers) and summarized over
the seeds as median and min..max. The hit ratio counts every reused prompt token: this
instance's device and host tiers and tokens pulled from a peer (`reuse_ratio`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.multiturn.capacity import CACHE_AWARE, OURS_WITH_PULLS
from benchmarks.multiturn.capacity_plots import plot_capacity
from benchmarks.multiturn.paired_report import FLOOR, Extra, Run, Target, configs, runs_of
from benchmarks.report.seeds import spread, spread_text
from benchmarks.report.table import table_section

TARGET_MULTIPLE = 4.0
TITLE = "Multi-turn capacity-bound benchmark: caches smaller than the working set"


def ratios(system: str, limits: Sequence[float] = (0.9, 2.0, 0.5, 1.5)) -> list[Target]:
    """`system`'s hit ratio against the oracle's and cache_aware's, its p99 TTFT against
    cache_aware's and the floor's, within a seed; `limits` in that order."""
    ca = CACHE_AWARE.name
    hit_oracle, hit_ca, p99_ca, p99_floor = limits
    return [
        Target(
            "hit_vs_oracle", "hit ratio / the oracle's", system, "hit_vs_oracle", ">=", hit_oracle
        ),
        Target(
            "hit_vs_cache_aware", f"hit ratio / {ca}'s", system, "reuse_ratio", ">=", hit_ca, ca
        ),
        Target("p99_vs_cache_aware", f"p99 TTFT / {ca}'s", system, "ttft_p99_s", "<=", p99_ca, ca),
        Target(
            "p99_vs_floor",
            "p99 TTFT / the floor's p99",
            system,
            "ttft_p99_s",
            "<=",
            p99_floor,
            FLOOR,
        ),
    ]


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """At 4x working set, for ours with pulls: hit >= 0.9x the oracle's and >= 2x
    cache_aware's, p99 TTFT <= 0.5x cache_aware's and <= 1.5x the floor's."""
    if not runs or runs[0].get("multiple") != TARGET_MULTIPLE:
        return []
    return [t for spec in OURS_WITH_PULLS for t in ratios(spec.name)]


def ratio_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per config and system, the four ratios: median [min..max] over the seeds."""
    rows = []
    for config in configs(runs):
        theirs = runs_of(runs, config, CACHE_AWARE.name)
        for system in dict.fromkeys(r["system"] for r in runs if r.get("config") == config):
            mine = runs_of(runs, config, system)
            if not mine:
                continue
            row: dict[str, Any] = {"config": config, "system": system}
            for target in ratios(system):
                values = [target.value(r, theirs.get(s)) for s, r in mine.items()]
                row[target.name.replace("_", " ")] = spread_text(spread(values), always=True)
            rows.append(row)
    return rows


def sizing_lines(runs: Sequence[Run], setup: dict[str, Any]) -> list[str]:
    """Per config its device KV and working set; per workload how it was sized."""
    out = []
    for config in configs(runs):
        mine = [r for r in runs if r.get("config") == config]
        first, cluster = mine[0], mine[0]["cluster_kv_tokens"]
        host = f", host tier {first['host_kv_tokens']:,} tokens" if first["hicache_ratio"] else ""
        text = (
            f"- {config}: device KV {first['instance_kv_tokens']:,} tokens an instance "
            f"({cluster:,} in the cluster){host}; working set estimated "
            f"{first['working_set_sizing']:,} tokens (median of the seeds)"
        )
        measured = [r["oracle_distinct_tokens"] for r in mine if r.get("oracle_distinct_tokens")]
        if measured:
            m = statistics.median(measured)
            text += f", measured {m:,.0f} (the oracle's pages): {m / cluster:.2f}x the device KV"
        out.append(text + ".")
    for name, s in setup.items():
        out.append(
            f"- `{name}`: time scale {s['time_scale']:g}; working set estimates per seed "
            f"{s['working_set_estimates']}; largest request {s['largest_request_tokens']:,} "
            f"tokens; device KV per instance by multiple {s['instance_kv_tokens']}."
        )
    return out


def extra(out_dir: Path, figures: dict[str, Any]) -> Extra:
    """The paired ratios of every system, the sizing, and the plots against the multiple."""
    runs, summary = figures["runs"], figures["summary"]
    rows = ratio_rows(runs)
    labels = {r["config"]: r for r in runs}  # a config's workload, multiple and host tier
    plots = plot_capacity(out_dir, [{**labels[e["config"]], **e} for e in summary])
    lines = [
        *table_section(
            "Paired ratios: median [min..max] over the seeds",
            rows,
            "Each ratio is taken within a seed (same requests, same workers), then summarized; "
            f"the targets are ours' at {TARGET_MULTIPLE:g}x.",
        ),
        "## Sizing",
        "",
        *sizing_lines(runs, figures["setup"]),
        "",
    ]
    return Extra("ratios", lines, {"rows": rows}, plots)
