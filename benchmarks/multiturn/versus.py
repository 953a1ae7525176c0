"""Per-system figures of a paired config against one baseline system, taken within each
seed (the same requests on the same workers) and listed seed by seed: the tables the LoRA
and tenants presets add to their pages."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.metrics import WARM_UP
from benchmarks.multiturn.paired_report import Run, label, runs_of
from benchmarks.multiturn.targets import pct
from benchmarks.report.seeds import ratio, spread, spread_text

# The column of the steady state's p99: the requests sent after the warm-up (metrics.WARM_UP)
WARM_P99 = "warm p99 s"


def per_seed_text(values: dict[int, float], digits: int = 2) -> str | None:
    """`a / b / c -> median` over the seeds (the seeds in order)."""
    if not values:
        return None
    seeds = sorted(values)
    shown = " / ".join(f"{values[s]:.{digits}f}" for s in seeds)
    if len(seeds) == 1:
        return shown
    return f"{shown} -> {statistics.median(values.values()):.{digits}f}"


def over_seeds(mine: dict[int, Run], of: Callable[[Run], Any]) -> dict[int, float]:
    """seed -> `of(run)`, where it is a finite number."""
    return {seed: value for seed, run in mine.items() if finite(value := of(run))}


def versus(mine: dict[int, Run], theirs: dict[int, Run], key: str) -> dict[int, float]:
    """seed -> mine's `key` over theirs in that seed (the same requests)."""
    return over_seeds(
        mine, lambda run: ratio(run.get(key), (theirs.get(run["seed"]) or {}).get(key))
    )


def mid(values: dict[int, float], digits: int = 3) -> str | None:
    """Median [min..max] of per-seed values."""
    return spread_text(spread(values.values()), digits)


@dataclass(frozen=True)
class Column:
    """A preset's own per-run figure: its key in results.json, its column (None: kept in
    results.json only) and how a run gives it."""

    key: str
    title: str | None
    of: Callable[[Run], Any]


def system_rows(
    runs: Sequence[Run],
    config: str,
    baseline: str,
    short: str,
    columns: Sequence[Column] = (),
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per system of `config`: TTFT mean and p99, hit, the `columns`, and the ratios of the
    TTFTs and the hit to `baseline`'s (a system label; `short` names it in the columns and
    keys) per seed with their median; and the same as figures for results.json."""
    systems = list(dict.fromkeys(label(r) for r in runs if r.get("config") == config))
    theirs = runs_of(runs, config, baseline)
    key = short.replace(" ", "_")
    # runs that timed their steady state (metrics.warm): its p99 beside the whole run's
    warm = any(r.get("ttft_warm_p99_s") is not None for r in runs if r.get("config") == config)
    rows, figures = [], []
    for system in systems:
        mine = runs_of(runs, config, system)
        if not mine:
            continue
        figure: dict[str, Any] = {
            "system": system,
            "seeds": sorted(mine),
            "ttft_mean_s": over_seeds(mine, lambda r: r.get("ttft_mean_s")),
            "ttft_p99_s": over_seeds(mine, lambda r: r.get("ttft_p99_s")),
            "hit_ratio": over_seeds(mine, lambda r: r.get("reuse_ratio")),
            **{c.key: over_seeds(mine, c.of) for c in columns},
            f"mean_vs_{key}": versus(mine, theirs, "ttft_mean_s"),
            f"p99_vs_{key}": versus(mine, theirs, "ttft_p99_s"),
            f"hit_vs_{key}": versus(mine, theirs, "reuse_ratio"),
        }
        if warm:
            figure["ttft_warm_p99_s"] = over_seeds(mine, lambda r: r.get("ttft_warm_p99_s"))
            figure[f"warm_p99_vs_{key}"] = versus(mine, theirs, "ttft_warm_p99_s")
        figures.append(figure)
        hits = spread(figure["hit_ratio"].values())
        rows.append(
            {
                "system": system,
                "TTFT mean s": mid(figure["ttft_mean_s"]),
                "p99 s": mid(figure["ttft_p99_s"]),
                "hit": pct(hits["median"]) if hits else None,
                **{c.title: mid(figure[c.key]) for c in columns if c.title},
                f"mean / {short} (per seed -> median)": per_seed_text(figure[f"mean_vs_{key}"]),
                f"p99 / {short} (per seed -> median)": per_seed_text(figure[f"p99_vs_{key}"]),
                f"hit / {short}": per_seed_text(figure[f"hit_vs_{key}"]),
            }
        )
        if warm:
            rows[-1][WARM_P99] = mid(figure["ttft_warm_p99_s"])
            rows[-1][f"{WARM_P99} / {short}"] = per_seed_text(figure[f"warm_p99_vs_{key}"])
    return rows, figures


def warm_text(rows: Sequence[dict[str, Any]]) -> str:
    """The sentence that says what the warm p99 columns count ("" when rows have none)."""
    if not any(WARM_P99 in row for row in rows):
        return ""
    return (
        f" {WARM_P99.removesuffix(' s').capitalize()}: of the requests sent after the first "
        f"{WARM_UP:.0%} of the sending (every cache is cold before it, and a rate sized for "
        "warm caches overloads every router alike)."
    )
