"""The figure: (a) latency each router adds per workload, (b) max requests/s per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.figures import pyplot, save
from benchmarks.router_overhead.settings import (
    TARGET_MULTI_TURN_ADDED_P50_MS,
    WORKLOAD_TITLES,
    WORKLOADS,
)


def plot(path: Path, fig: dict[str, Any]) -> None:
    plt = pyplot()

    systems = [s for s in fig["systems"] if s["available"]]
    routers = [s for s in systems if s["kind"] != "baseline"]
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(15, 5.2), constrained_layout=True, gridspec_kw={"width_ratios": [2, 1.2]}
    )
    width = 0.8 / max(len(routers), 1)
    for k, s in enumerate(routers):
        xs = [i + (k - (len(routers) - 1) / 2) * width for i in range(len(WORKLOADS))]
        p99 = [s["added_ms"][w]["p99"] for w in WORKLOADS]
        p50 = [s["added_ms"][w]["p50"] for w in WORKLOADS]
        left.bar(xs, p50, width * 0.9, color=f"C{k}", label=f"{s['name']} (bar: p50)")
        left.plot(xs, p99, "_", color="k", ms=14, mew=2, label="p99" if k == 0 else None)
    left.axhline(0, color="k", lw=0.6)
    left.plot(
        [2 - 0.45, 2 + 0.45],
        [TARGET_MULTI_TURN_ADDED_P50_MS] * 2,
        "k--",
        lw=1,
        label=f"multi-turn target p50 {TARGET_MULTI_TURN_ADDED_P50_MS:g} ms",
    )
    left.set_xticks(range(len(WORKLOADS)), [WORKLOAD_TITLES[w] for w in WORKLOADS])
    left.set_ylabel("added latency vs direct (ms)")
    left.set_title("(a) latency a router adds (bars p50, black ticks p99)")
    left.grid(True, axis="y", alpha=0.3)
    left.legend(fontsize=7, ncol=2)

    names = [s["name"] for s in systems if s["rps"]]
    values = [s["rps"]["rps"] for s in systems if s["rps"]]
    colors = ["0.5"] + [f"C{k}" for k in range(len(names) - 1)]
    bars = right.bar(range(len(names)), values, color=colors)
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_xticks(
        range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=6, rotation=45
    )
    right.set_ylabel("requests/s")
    settings = fig["config"]["settings"]
    right.set_title(f"(b) max rps, {settings['concurrency']} clients, max_tokens 1")
    right.grid(True, axis="y", alpha=0.3)
    figure.suptitle("Router overhead over 2 sim workers (--time-scale 0)")
    save(figure, path, dpi=120)
