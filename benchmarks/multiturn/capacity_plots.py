"""The capacity preset's plots: hit ratio and p99 TTFT against the working-set multiple.

One row of panels per workload, one column per host tier setting, one line per system at
its median over the seeds, the seeds' spread (min..max) as error bars; the oracle's hit
ratio and the floor's p99 as dashed black lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.paired_report import med
from benchmarks.report.figures import color, pyplot, save

HIT_PLOT = "capacity_hit_ratio.png"
P99_PLOT = "capacity_p99_ttft.png"


def _panel(ax: Any, subset: list[dict[str, Any]], key: str, reference: str) -> None:
    """One line per system, and the reference (oracle or floor: the same requests for
    every system) from the first system's runs."""
    systems = list(dict.fromkeys(e["system"] for e in subset))
    for system in systems:
        mine = [e for e in subset if e["system"] == system]
        _line(ax, mine, key, color=color(system), label=system)
    first = [e for e in subset if e["system"] == systems[0]]
    _line(ax, first, reference, color="k", ls="--", label=reference.split("_")[0])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({e["multiple"] for e in subset}))
    ax.get_xaxis().set_major_formatter(lambda x, _: f"{x:g}x")
    ax.grid(True, alpha=0.3)


def _line(ax: Any, entries: list[dict[str, Any]], key: str, **style: Any) -> None:
    """The median of `key` against the multiple, the seeds' min..max as error bars."""
    points = sorted(
        ((e["multiple"], e[key]) for e in entries if finite(med(e, key))), key=lambda p: p[0]
    )
    if not points:
        return
    ys = [f["median"] for _, f in points]
    lo = [y - f["min"] for y, (_, f) in zip(ys, points, strict=True)]
    hi = [f["max"] - y for y, (_, f) in zip(ys, points, strict=True)]
    ax.errorbar([m for m, _ in points], ys, yerr=[lo, hi], marker="o", capsize=3, **style)


def plot_capacity(out_dir: Path, summary: Sequence[dict[str, Any]]) -> list[str]:
    """Both plots when the summary has anything to show; the file names written. An entry
    is `paired_report.summarize`'s with its config's workload, multiple and host tier."""
    if not summary:
        return []
    written = []
    workloads = sorted({e["workload"] for e in summary})
    tiers = sorted({e["hicache_ratio"] for e in summary})
    for name, key, reference, ylabel, log in (
        (HIT_PLOT, "reuse_ratio", "oracle_hit_ratio", "reused / prompt tokens", False),
        (P99_PLOT, "ttft_p99_s", "floor_ttft_p99_s", "p99 TTFT (s)", True),
    ):
        fig, axes = pyplot().subplots(
            len(workloads),
            len(tiers),
            figsize=(max(5.6 * len(tiers), 8.0), 4.4 * len(workloads)),
            squeeze=False,
            constrained_layout=True,
        )
        for row, workload in zip(axes, workloads, strict=True):
            for ax, host in zip(row, tiers, strict=True):
                cell = (workload, host)
                subset = [e for e in summary if (e["workload"], e["hicache_ratio"]) == cell]
                if subset:
                    _panel(ax, subset, key, reference)
                if log:
                    ax.set_yscale("log")
                else:
                    ax.set_ylim(0, 1)
                ax.set_xlabel("working set / cluster device KV")
                ax.set_ylabel(ylabel)
                tier = f"host tier {host:g}x" if host else "no host tier"
                ax.set_title(f"{workload}, {tier}")
        axes[0][0].legend(fontsize=7)
        what = "hit ratio (device + host + pulled)" if key == "reuse_ratio" else "p99 TTFT"
        fig.suptitle(f"Capacity-bound: {what}; median over the seeds, bars: min..max")
        if save(fig, out_dir / name):
            written.append(name)
    return written
