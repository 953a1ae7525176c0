"""overload.png: goodput, p99 TTFT and the longest wait against the offered load, one line per
system (the median over seeds), the band its min..max over seeds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.overload.preset import WITH_DEADLINE
from benchmarks.overload.targets import GOODPUT_KEPT, by_step
from benchmarks.report.figures import color, pyplot, save
from benchmarks.report.seeds import spread

PNG = "overload.png"

# (key, title, log scale)
PANELS = (
    ("goodput_rps", "goodput (req/s answered within their TTFT SLO)", False),
    ("ttft_p99_s", "p99 TTFT of admitted requests (s)", True),
    ("wait_max_s", "longest wait of an admitted request (s)", True),
)


def band(
    seeds: dict[int, dict[str, Any]], key: str, positive: bool = False
) -> tuple[float, float, float] | None:
    """(median, min, max) of `key` over the seeds' runs (None without a value; only values
    above 0 when `positive`, for a log scale)."""
    s = spread(r.get(key) for r in seeds.values() if not positive or (r.get(key) or 0) > 0)
    return (s["median"], s["min"], s["max"]) if s else None


def plot(
    out_dir: Path,
    runs: Sequence[dict[str, Any]],
    systems: Sequence[str],
    sustained_rps: float,
    deadline_s: float,
) -> str | None:
    """Write the figure; its file name, or None without runs."""
    if not runs:
        return None
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.6), constrained_layout=True)
    for system in systems:
        steps = by_step(runs, system)
        for ax, (key, _, log) in zip(axes, PANELS, strict=True):
            pts = [(f * 100, b) for f, seeds in steps.items() if (b := band(seeds, key, log))]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ax.plot(xs, [b[0] for _, b in pts], marker="o", color=color(system), label=system)
            ax.fill_between(
                xs, [b[1] for _, b in pts], [b[2] for _, b in pts], color=color(system), alpha=0.2
            )
    for ax, (_, title, log) in zip(axes, PANELS, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"offered load, % of the sustained {sustained_rps:.2f} req/s")
        ax.axvline(100, color="grey", lw=0.8, ls=":")
        ax.grid(True, alpha=0.3)
        if log:
            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.tick_params(axis="y", which="minor", labelsize=7)
        else:
            ax.set_ylim(bottom=0)
    ours = by_step(runs, WITH_DEADLINE)
    peaks = [b[0] for seeds in ours.values() if (b := band(seeds, "goodput_rps"))]
    if peaks:
        kept = GOODPUT_KEPT * max(peaks)
        label = f"{GOODPUT_KEPT:.0%} of ours + deadline's peak"
        axes[0].axhline(kept, color=color(WITH_DEADLINE), ls=":", lw=1, label=label)
    axes[2].axhline(deadline_s, color="k", ls="--", lw=1, label=f"deadline D = {deadline_s:.2f} s")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(
        "Overload ramp, 4 colocated sim workers: lines the median over seeds, bands min..max"
    )
    save(fig, out_dir / PNG)
    return PNG
