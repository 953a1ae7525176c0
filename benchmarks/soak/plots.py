"""The two figures: latency percentiles over time, and RSS of every process over time (with
the cache gauges beneath, so memory can be read against what the caches held)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.figures import pyplot, save


def plot_latency(path: Path, fig: dict[str, Any]) -> None:
    plt = pyplot()
    rows = fig["windows"]
    mids = [(w["t0_s"] + w["t1_s"]) / 2 / 60 for w in rows]
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 6.5), sharex=True, constrained_layout=True
    )
    for key, style, label in (
        ("e2e_p50_ms", "C0-", "end to end p50"),
        ("e2e_p99_ms", "C0--", "end to end p99"),
        ("ttft_p50_ms", "C1-", "TTFT p50 (streams)"),
        ("ttft_p99_ms", "C1--", "TTFT p99 (streams)"),
    ):
        xs = [x for x, w in zip(mids, rows, strict=True) if w[key] is not None]
        ys = [w[key] for w in rows if w[key] is not None]
        top.plot(xs, ys, style, marker=".", label=label)
    warm = fig["verdict"]["warmup_s"] / 60
    top.axvline(warm, color="0.5", lw=0.8, ls=":", label="warm-up end")
    top.set_yscale("log")
    top.set_ylabel("ms")
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    top.set_title("latency per window of request start times")
    width = (rows[0]["t1_s"] - rows[0]["t0_s"]) / 60 * 0.9 if rows else 0.1
    bottom.bar(mids, [w["requests"] for w in rows], width, color="0.75", label="requests")
    bottom.bar(mids, [w["errors"] for w in rows], width, color="C3", label="unexpected errors")
    bottom.set_ylabel("per window")
    bottom.set_xlabel("minutes since the load began")
    bottom.legend(fontsize=8)
    c = fig["config"]
    figure.suptitle(f"Soak: {c['rps']:g} req/s for {c['minutes']:g} min")
    save(figure, path)


def plot_rss(path: Path, fig: dict[str, Any]) -> None:
    plt = pyplot()
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 7), sharex=True, constrained_layout=True
    )
    warm = fig["verdict"]["warmup_s"] / 60
    slopes = {r["process"]: r["slope_mib_per_min"] for r in fig["processes"]}
    for k, (name, points) in enumerate(sorted(fig["rss_series"].items())):
        xs = [p[0] / 60 for p in points]
        ys = [p[1] for p in points]
        slope = slopes.get(name)
        label = f"{name} ({slope:+.2f} MiB/min after warm-up)" if slope is not None else name
        top.plot(xs, ys, color=f"C{k % 10}", lw=1.2, label=label)
    top.axvspan(0.0, warm, color="0.9", zorder=0, label="warm-up")
    top.set_ylabel("VmRSS (MiB)")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=7)
    threshold = fig["verdict"]["threshold_mib_per_min"]
    verdict = "flat" if fig["verdict"]["memory_flat"] else "NOT flat"
    top.set_title(
        f"RSS of every process: {verdict} after warm-up (threshold {threshold:g} MiB/min)"
    )
    for k, (name, gauges) in enumerate(sorted(fig["gauge_series"].items())):
        key = "tree_pages" if "tree_pages" in gauges else "used_blocks"
        points = gauges.get(key)
        if not points:
            continue
        xs = [p[0] / 60 for p in points]
        bottom.plot(xs, [p[1] for p in points], color=f"C{k % 10}", lw=1, label=f"{name} {key}")
    bottom.set_ylabel("pages / blocks")
    bottom.set_xlabel("minutes since the load began")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=7)
    bottom.set_title("router tree pages and workers' used KV blocks")
    save(figure, path)


def plot(out_dir: Path, fig: dict[str, Any]) -> None:
    from benchmarks.soak.report import LATENCY_PNG, RSS_PNG

    plot_latency(out_dir / LATENCY_PNG, fig)
    plot_rss(out_dir / RSS_PNG, fig)
