"""PNG plots (matplotlib, Agg): latency against rate, per-turn TTFT, hit ratio against the
oracle, share ratio (MemServe fig. 14) and the PD clusters."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.report.figures import color, pyplot, save


def _series(
    axes: Sequence[Any],
    pts: dict[str, list[tuple[Any, dict[str, Any]]]],
    values: Sequence[Callable[[dict[str, Any]], Any]],
) -> None:
    """Per system, one line on each axis: x against `values[i](run)` on `axes[i]`."""
    for system, items in sorted(pts.items()):
        items.sort(key=lambda x: x[0])
        xs = [x for x, _ in items]
        for ax, value in zip(axes, values, strict=True):
            ys = [value(r) for _, r in items]
            ax.plot(xs, ys, marker="o", color=color(system), label=system)


def _ok(run: dict[str, Any]) -> bool:
    return bool(run.get("available")) and finite(run.get("ttft_mean_s"))


def plot_all(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every plot the runs allow; returns the file names written."""
    written = []
    for run in runs:
        color(run["system"])
    for name, fn in (
        ("latency_vs_rate.png", plot_rate),
        ("per_turn_ttft.png", plot_per_turn),
        ("hit_ratio.png", plot_hits),
        ("share_ratio.png", plot_share),
        ("pd.png", plot_pd),
    ):
        if fn(out_dir / name, runs):
            written.append(name)
    return written


def plot_rate(path: Path, runs: Sequence[dict[str, Any]]) -> bool:
    """TTFT (mean, p99) and JCT mean against the offered rate, per system (multi-round QA)."""
    pts: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for run in runs:
        mrqa = run["workload"] == "multi_round_qa" and run["cluster"] == "4 colocated"
        if mrqa and run["group"] in ("main", "rate_sweep") and _ok(run):
            pts.setdefault(run["system"], []).append((run["rate"], run))
    pts = {k: v for k, v in pts.items() if len(v) > 1}  # systems the sweep ran
    if not pts:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    keys = ("ttft_mean_s", "ttft_p99_s", "jct_mean_s")
    _series(axes, pts, [operator.itemgetter(k) for k in keys])
    for ax, title in zip(axes, ("TTFT mean (s)", "TTFT p99 (s)", "JCT mean (s)"), strict=True):
        ax.set_xlabel("offered requests/s (4 instances)")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Multi-round QA on 4 colocated sim instances: latency against request rate")
    return save(fig, path)


def plot_per_turn(path: Path, runs: Sequence[dict[str, Any]]) -> bool:
    panels = [
        w
        for w in ("multi_round_qa", "sharegpt", "react", "trace")
        if any(r["workload"] == w and r["group"] == "main" and _ok(r) for r in runs)
    ]
    if not panels:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    for ax, workload in zip(axes[0], panels, strict=True):
        for run in runs:
            if run["workload"] != workload or run["group"] != "main" or not _ok(run):
                continue
            turns = run.get("per_turn_ttft_mean_s") or {}
            counts = run.get("per_turn_requests") or {}
            xs = [int(t) + 1 for t in turns if counts.get(t, 0) >= 3]
            ys = [turns[t] for t in turns if counts.get(t, 0) >= 3]
            ax.plot(xs, ys, marker=".", color=color(run["system"]), label=run["system"])
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{workload}: mean TTFT by turn")
        ax.set_xlabel("turn")
        ax.set_ylabel("s")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    return save(fig, path)


def plot_hits(path: Path, runs: Sequence[dict[str, Any]]) -> bool:
    """Hit ratio per system and workload (4 colocated, main runs) against the oracle."""
    workloads = []
    for run in runs:
        if run["group"] in ("main", "no_cache") and _ok(run) and run["workload"] not in workloads:
            workloads.append(run["workload"])
    if not workloads:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        subset = [
            r for r in runs if r["workload"] == workload and r["group"] in ("main", "no_cache")
        ]
        subset = [r for r in subset if _ok(r)]
        seeded = any(r.get("seed") is not None for r in subset)
        if seeded:  # one group of bars per seed, each seed's own oracle over its bars
            subset.sort(key=lambda r: r.get("seed") or 0)
        names = [
            r["system"]
            + (" (no cache)" if not r["radix_cache"] else "")
            + (f", seed {r.get('seed')}" if seeded else "")
            for r in subset
        ]
        hits = [r.get("hit_ratio") or 0 for r in subset]
        oracle = max((r.get("oracle_hit_ratio") or 0 for r in subset), default=0)
        ax.bar(range(len(subset)), hits, color=[color(r["system"]) for r in subset])
        if seeded:
            xs = range(len(subset))
            oracles = [r.get("oracle_hit_ratio") or 0 for r in subset]
            ax.hlines(oracles, [x - 0.45 for x in xs], [x + 0.45 for x in xs], color="k", lw=1)
            ax.plot([], [], color="k", lw=1, label="its seed's oracle")
        else:
            ax.axhline(oracle, color="k", ls="--", lw=1, label=f"oracle {oracle:.0%}")
            ax.axhline(0.9 * oracle, color="k", ls=":", lw=1, label="90% of oracle")
        ax.set_xticks(range(len(subset)), names, rotation=70, fontsize=7, ha="right")
        ax.set_ylim(0, 1)
        ax.set_title(workload)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("cached / prompt tokens")
    fig.suptitle("Token hit ratio against the oracle (4 colocated instances)")
    fig.tight_layout()
    return save(fig, path)


def plot_share(path: Path, runs: Sequence[dict[str, Any]]) -> bool:
    pts: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for run in runs:
        if run["group"] == "share_ratio" and _ok(run):
            ratio = (run.get("workload_params") or {}).get("share_ratio")
            pts.setdefault(run["system"], []).append((ratio, run))
    if not pts:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
    _series(axes, pts, [operator.itemgetter("ttft_p99_s"), lambda r: r.get("hit_ratio") or 0])
    axes[0].set_title("p99 TTFT (s)")
    axes[1].set_title("hit ratio")
    for ax in axes:
        ax.set_xlabel("share ratio (identical copies of each session)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("LooGLE-like document QA, 4 colocated: prompt tree vs session (MemServe fig. 14)")
    return save(fig, path)


def plot_pd(path: Path, runs: Sequence[dict[str, Any]]) -> bool:
    subset = [r for r in runs if r["group"] == "pd" and _ok(r)]
    if not subset:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), constrained_layout=True)
    names = [f"{r['cluster']}\n{r['system']}" for r in subset]
    xs = range(len(subset))
    for ax, key, title in (
        (axes[0], "ttft", "TTFT (s): bars mean, ticks p99"),
        (axes[1], "jct", "JCT (s): bars mean, ticks p99"),
    ):
        ax.bar(xs, [r[f"{key}_mean_s"] for r in subset], color="C0")
        ax.plot(xs, [r[f"{key}_p99_s"] for r in subset], "_", color="k", ms=16, mew=2)
        ax.set_title(title)
    axes[2].bar(xs, [(r.get("kv_bytes_moved") or 0) / 2**30 for r in subset], color="C2")
    axes[2].set_title("KV moved between instances (GiB, modelled)")
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=60, fontsize=7, ha="right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("PD clusters at equal instance count (2): ShareGPT-like multi-turn")
    return save(fig, path)
