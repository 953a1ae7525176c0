"""The sweep's own part of its report (`paired_report.write_paired`'s `extra`): the cells,
the table (per cell and system: mean and p99 TTFT, their ratios to cache_aware per seed and
the median, the hit ratio, ours' prediction of cached tokens), the targets in short, and the
heat map of ours' ratios to cache_aware per cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.paired_report import (
    Extra,
    Run,
    configs,
    find_entry,
    label,
    med,
    runs_of,
    slug,
)
from benchmarks.multiturn.sweep_preset import (
    CACHE_AWARE,
    ENGINE_TEXT,
    OURS_SYSTEMS,
    SYSTEMS,
    cell_of,
    targets_for,
)
from benchmarks.multiturn.targets import foreseen, pct, prediction
from benchmarks.multiturn.workloads import CHAT
from benchmarks.report.figures import pyplot, save
from benchmarks.report.seeds import median_of, paired, ratio
from benchmarks.report.table import markdown_table, rounded

HEATMAP = "sweep_heatmap.png"
FIGURES = (("mean", "ttft_mean_s"), ("p99", "ttft_p99_s"))


def per_seed_ratios(mine: dict[int, Run], theirs: dict[int, Run], figure: str) -> dict[int, float]:
    """seed -> mine's figure over theirs in that seed (seeds where both ran without errors)."""
    return paired(
        mine,
        theirs,
        lambda a, b: (
            None if a.get("errors") or b.get("errors") else ratio(a.get(figure), b.get(figure))
        ),
    )


def seeds_text(values: dict[int, float]) -> str | None:
    """Per seed, in seed order: `0.91/0.88/0.95`."""
    return "/".join(f"{values[s]:.2f}" for s in sorted(values)) if values else None


def cell_rows(
    runs: Sequence[Run], summary: Sequence[dict[str, Any]], calibration: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per cell: what it sets, its KV and rate, the machine's figures."""
    rows = []
    for config in configs(runs):
        mine = [r for r in runs if r.get("config") == config and r.get("available")]
        cell = cell_of(mine)
        if cell is None:
            continue
        first = mine[0]
        cal = calibration.get(config) or {}
        entries = [e for e in summary if e["config"] == config]
        cpu = [med(e, "cpu_ms_per_request") for e in entries]
        gpu = [med(e, "gpu_utilization") for e in entries]
        loads = [r["loadavg_1m"] for r in mine if finite(r.get("loadavg_1m"))]
        rows.append(
            {
                "cell": config,
                "Zipf": cell.zipf,
                "prefixes": cell.prefixes,
                "prefix tokens": cell.prefix_tokens,
                "prompts": "chats" if cell.route == CHAT else "text",
                "load": f"{cell.load:.0%}",
                "engines": ENGINE_TEXT.get(cell.engine, cell.engine).removeprefix("4 colocated, "),
                "KV/worker": first.get("instance_kv_tokens"),
                "hot set": first.get("hot_set_tokens"),
                "sustained req/s": rounded(cal.get("sustained_rps"), 2),
                "offered req/s": rounded(first.get("rate"), 2),
                "seeds": len({r["seed"] for r in mine}),
                "GPU busy": pct(median_of(gpu)),
                "CPU ms/req": rounded(median_of(cpu), 0),
                "max machine load": rounded(max(loads), 1) if loads else None,
            }
        )
    return rows


def table_rows(runs: Sequence[Run], summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and system: TTFT, ratios to cache_aware (per seed and median), hit ratio,
    ours' prediction of cached tokens."""
    ca = CACHE_AWARE.name
    rows = []
    for config in configs(runs):
        theirs = runs_of(runs, config, ca)
        seen = dict.fromkeys(label(r) for r in runs if r.get("config") == config)
        order = [s.name for s in SYSTEMS]  # the preset's order, not the rotated run order
        systems = sorted(seen, key=lambda s: order.index(s) if s in order else len(order))
        for system in systems:
            mine = runs_of(runs, config, system)
            if not mine:
                continue
            entry = find_entry(summary, config, system)
            row: dict[str, Any] = {
                "cell": config,
                "system": system,
                "seeds": len(mine),
                "TTFT mean s": rounded(med(entry, "ttft_mean_s")),
                "TTFT p99 s": rounded(med(entry, "ttft_p99_s")),
            }
            for name, figure in FIGURES:
                per_seed = {} if system == ca else per_seed_ratios(mine, theirs, figure)
                row[f"{name}/CA per seed"] = seeds_text(per_seed)
                row[f"{name}/CA"] = rounded(median_of(list(per_seed.values())), 2)
                row[f"_{name}_per_seed"] = per_seed
            row["hit"] = pct(med(entry, "reuse_ratio"))
            predicted = [p for r in mine.values() if finite(p := prediction(r))]
            row["predicted/reported cached"] = rounded(median_of(predicted), 2)
            hits = [f for r in mine.values() if finite(f := foreseen(r))]
            if hits:  # (routers from before it counted them: no column)
                row["foreseen/reported cached"] = rounded(median_of(hits), 2)
            row["errors"] = entry.get("errors")
            rows.append(row)
    return rows


def shown(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their hidden (JSON-only) columns."""
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def missed(runs: Sequence[Run], targets: dict[str, Any]) -> dict[tuple[str, str, str], bool]:
    """(cell, system, figure) -> whether a target on it was missed (True) or all met."""
    out: dict[tuple[str, str, str], bool] = {}
    for config in configs(runs):
        mine = [r for r in runs if r.get("config") == config]
        for target in targets_for(config, mine):
            t = targets.get(slug(f"{config}_{target.mine}_{target.name}"))
            if t is None:
                continue
            key = (config, target.mine, target.figure)
            out[key] = out.get(key, False) or t.get("met") is False
    return out


def heatmap_data(
    rows: Sequence[dict[str, Any]], runs: Sequence[Run], targets: dict[str, Any]
) -> dict[str, Any]:
    """Cells x (ours system, mean | p99): the median ratio to cache_aware, and which missed
    a target."""
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    columns = [(s.name, name, figure) for s in OURS_SYSTEMS for name, figure in FIGURES]
    by = {(r["cell"], r["system"]): r for r in rows}
    misses = missed(runs, targets)
    values, flags = [], []
    for cell in cells:
        values.append([(by.get((cell, s)) or {}).get(f"{n}/CA") for s, n, _ in columns])
        flags.append([misses.get((cell, s, f), False) for s, _, f in columns])
    return {
        "cells": cells,
        "columns": [f"{s.removeprefix('ours ')} {n}" for s, n, _ in columns],
        "values": values,
        "missed": flags,
    }


def plot_heatmap(path: Path, data: dict[str, Any]) -> bool:
    """Ours' median ratio to cache_aware per cell (rows) and system x figure (columns):
    green below 1 (faster), red above; a missed target's square framed in black."""
    cells, columns, values = data["cells"], data["columns"], data["values"]
    if not cells or not any(finite(v) for row in values for v in row):
        return False
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    grid = [[v if finite(v) else float("nan") for v in row] for row in values]
    fig, ax = plt.subplots(
        figsize=(1.6 * len(columns) + 3.2, 0.42 * len(cells) + 1.6), constrained_layout=True
    )
    norm = TwoSlopeNorm(vmin=0.4, vcenter=1.0, vmax=1.6)
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=norm, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            text = f"{value:.2f}" if finite(value) else "—"
            dark = finite(value) and not 0.55 <= value <= 1.45  # white on the deep ends
            ax.text(j, i, text, ha="center", va="center", fontsize=8, c="w" if dark else "k")
            if data["missed"][i][j]:
                ax.add_patch(
                    plt.Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, lw=2, ec="black")
                )
    ax.set_xticks(range(len(columns)), columns, fontsize=8)
    ax.set_yticks(range(len(cells)), cells, fontsize=8)
    ax.xaxis.tick_top()
    fig.colorbar(image, ax=ax, label="ours / cache_aware (median)")
    ax.set_title("TTFT, ours over cache_aware per cell (framed: a target missed)", fontsize=9)
    return bool(save(fig, path))


def target_summary(targets: dict[str, Any]) -> list[str]:
    """How many targets were met, and each missed one with its cell's numbers."""
    met = [t for t in targets.values() if t.get("met") is True]
    lines = [f"{len(met)} of {len(targets)} targets met."]
    for t in targets.values():
        if t.get("met") is True:
            continue
        state = "missed" if t.get("met") is False else "not measured"
        value = t.get("value")
        shown_value = f"{value:.2f}" if finite(value) else "?"
        lines.append(
            f"- {state}: {t['about']} = {shown_value} (limit {t['op']} {t['limit']:g}; seeds "
            f"{seeds_text(t.get('per_seed') or {}) or '?'}): {t.get('detail', '')}"
        )
    return lines


def extra(out_dir: Path, figures: dict[str, Any]) -> Extra:
    """The sweep's part of README.md and results.json (`sweep`), and its heat map."""
    runs, summary, targets = figures["runs"], figures["summary"], figures["targets"]
    cells = cell_rows(runs, summary, figures["calibration"])
    rows = table_rows(runs, summary)
    data = heatmap_data(rows, runs, targets)
    plots = [HEATMAP] if plot_heatmap(Path(out_dir) / HEATMAP, data) else []
    lines = [
        "## The sweep",
        "",
        "Per cell and system: TTFT (median over the seeds), its ratio to sglang-router "
        "cache_aware's in the same seed (per seed in seed order, and their median), the "
        "hit ratio, and for ours the cached tokens its trees predicted over those the "
        "workers reported (and, where its router counts them, the reported cached tokens "
        "it had foreseen, per answer the lesser of predicted and reported, over the "
        "reported ones).",
        "",
        markdown_table(shown(rows)),
        "",
        "## Cells",
        "",
        markdown_table(cells),
        "",
        "## Targets in short",
        "",
        *target_summary(targets),
        "",
    ]
    figures = {
        "cells": cells,
        "rows": [
            {**{k: v for k, v in r.items() if not k.startswith("_")}, **per_seed_fields(r)}
            for r in rows
        ],
        "heatmap": data,
    }
    return Extra("sweep", lines, figures, plots)


def per_seed_fields(row: dict[str, Any]) -> dict[str, Any]:
    return {f"{n}_vs_cache_aware_per_seed": row.get(f"_{n}_per_seed") or {} for n, _ in FIGURES}
