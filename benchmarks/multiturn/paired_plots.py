"""The paired presets' plots: TTFT CDF per system, and each worker's share of busy time.

One panel per config. The CDF pools the measured TTFTs of every seed (the same requests
for every system of a config); the floor's p99 is a dashed black line. The busy plot has
one group of bars per system, one bar per worker (its median share over the seeds of its
role's busy time), and the even share and half of it (the balance target) as lines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.report.figures import color, pyplot, save
from benchmarks.report.seeds import configs

CDF_PLOT = "ttft_cdf.png"
BUSY_PLOT = "worker_busy.png"


def plot_paired(
    out_dir: Path,
    runs: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]],
    label: Callable[[dict[str, Any]], str],
) -> list[str]:
    """Both plots when the runs have anything to show; the file names written."""
    names = configs([r for r in runs if r.get("available")])
    if not names:
        return []
    written = []
    if plot_cdf(out_dir / CDF_PLOT, runs, names, label):
        written.append(CDF_PLOT)
    if plot_busy(out_dir / BUSY_PLOT, summary, names):
        written.append(BUSY_PLOT)
    return written


def _grid(n: int, width: float, height: float) -> tuple[Any, list[Any]]:
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = pyplot().subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, constrained_layout=True
    )
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot_cdf(
    path: Path,
    runs: Sequence[dict[str, Any]],
    configs: list[str],
    label: Callable[[dict[str, Any]], str],
) -> bool:
    fig, axes = _grid(len(configs), 6.4, 4.4)
    drawn = False
    for ax, config in zip(axes, configs, strict=True):
        mine = [r for r in runs if r.get("config") == config and r.get("available")]
        pooled: dict[str, list[float]] = {}
        for run in mine:
            pooled.setdefault(label(run), []).extend(run.get("ttft_samples_s") or [])
        for system, samples in pooled.items():
            if not samples:
                continue
            xs = sorted(samples)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=color(system), label=system)
            drawn = True
        floors = [r["floor_ttft_p99_s"] for r in mine if finite(r.get("floor_ttft_p99_s"))]
        if floors:
            ax.axvline(max(floors), color="k", ls="--", lw=1, label="floor p99")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(config, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.suptitle("TTFT CDF per system (every seed's requests pooled)")
    if not drawn:
        pyplot().close(fig)
        return False
    return save(fig, path)


def plot_busy(path: Path, summary: Sequence[dict[str, Any]], configs: list[str]) -> bool:
    fig, axes = _grid(len(configs), 7.0, 4.2)
    drawn = False
    for ax, config in zip(axes, configs, strict=True):
        entries = [e for e in summary if e["config"] == config and e.get("busy_shares")]
        for x, entry in enumerate(entries):
            shares = entry["busy_shares"]
            roles = entry.get("worker_roles") or ["worker"] * len(shares)
            width = 0.8 / max(len(shares), 1)
            for i, share in enumerate(shares):
                if not finite(share):
                    continue
                left = x - 0.4 + i * width
                style = {"hatch": "//"} if roles[i] == "decode" else {}
                ax.bar(left, share, width * 0.9, align="edge", color=f"C{i}", **style)
                drawn = True
            group = {r: roles.count(r) for r in roles}
            even = 1 / max(group.values()) if group else 0
            ax.hlines([even, even / 2], x - 0.4, x + 0.4, colors="k", linestyles=["-", ":"], lw=1)
        ax.set_xticks(range(len(entries)), [e["system"] for e in entries], rotation=25, fontsize=6)
        ax.set_ylabel("share of its role's busy time")
        ax.set_title(config, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Busy time per worker (hatched: decode); line: even share, dotted: half")
    if not drawn:
        pyplot().close(fig)
        return False
    return save(fig, path)
