"""The capacity preset's plots: hit ratio and p99 TTFT against the working-set multiple.

One panel per (workload, host tier), one line per system at its median over the seeds, the
seeds' spread (min..max) as error bars; the oracle's hit ratio and the floor's p99 as
dashed black lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.plots import _plt, _save, color

HIT_PLOT = "capacity_hit_ratio.png"
P99_PLOT = "capacity_p99_ttft.png"


def panels(summary: Sequence[dict[str, Any]]) -> list[tuple[str, float]]:
    return sorted({(e["workload"], e["hicache_ratio"]) for e in summary})


def _line(ax: Any, entries: list[dict[str, Any]], key: str, **style: Any) -> None:
    """The median of `key` against the multiple, the seeds' min..max as error bars."""
    entries = sorted((e for e in entries if finite(e.get(key))), key=lambda e: e["multiple"])
    if not entries:
        return
    xs = [e["multiple"] for e in entries]
    ys = [e[key] for e in entries]
    lo = [y - (e.get(f"{key}_range") or [y, y])[0] for e, y in zip(entries, ys, strict=True)]
    hi = [(e.get(f"{key}_range") or [y, y])[1] - y for e, y in zip(entries, ys, strict=True)]
    ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, **style)


def plot_capacity(out_dir: Path, summary: Sequence[dict[str, Any]]) -> list[str]:
    """Both plots when the summary has anything to show; the file names written."""
    if not summary:
        return []
    written = []
    for name, key, reference, ylabel, log in (
        (HIT_PLOT, "reuse_ratio", "oracle_hit_ratio", "reused / prompt tokens", False),
        (P99_PLOT, "ttft_p99_s", "floor_ttft_p99_s", "p99 TTFT (s)", True),
    ):
        plt = _plt()
        cells = panels(summary)
        fig, axes = plt.subplots(
            1,
            len(cells),
            figsize=(max(5.2 * len(cells), 8.0), 4.8),
            squeeze=False,
            constrained_layout=True,
        )
        for ax, (workload, host) in zip(axes[0], cells, strict=True):
            subset = [e for e in summary if (e["workload"], e["hicache_ratio"]) == (workload, host)]
            for system in dict.fromkeys(e["system"] for e in subset):
                mine = [e for e in subset if e["system"] == system]
                _line(ax, mine, key, color=color(system), label=system)
            # the reference (oracle or floor) is the same workload for every system
            first = dict.fromkeys(e["system"] for e in subset)
            some = [e for e in subset if e["system"] == next(iter(first))]
            _line(ax, some, reference, color="k", ls="--", label=reference.split("_")[0])
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({e["multiple"] for e in subset}))
            ax.get_xaxis().set_major_formatter(lambda x, _: f"{x:g}x")
            if log:
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 1)
            ax.set_xlabel("working set / cluster device KV")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{workload}, " + (f"host tier {host:g}x" if host else "no host tier"))
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        what = "hit ratio (device + host + pulled)" if key == "reuse_ratio" else "p99 TTFT"
        fig.suptitle(f"Capacity-bound: {what}; median over the seeds, bars: min..max")
        if _save(fig, out_dir / name):
            written.append(name)
    return written
