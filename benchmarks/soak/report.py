"""results.json, results.md and the two plots: latency per window, and RSS of every process
over time with the cache gauges beneath (memory read against what the caches held)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.figures import pyplot, save
from benchmarks.report.page import write_results
from benchmarks.report.table import table_section

NAME = "results"
LATENCY_PNG = "latency.png"
RSS_PNG = "rss.png"


def headline(fig: dict[str, Any]) -> list[dict[str, Any]]:
    lat, p99, mempool = fig["latency"], fig["e2e_p99_range_ms"], fig["mempool"]
    slopes = [r["slope_mib_per_min"] for r in fig["processes"]]
    slopes = [s for s in slopes if s is not None]
    return [
        {
            "requests": fig["load"]["offered"],
            "unexpected errors": fig["unexpected_errors"],
            "e2e p50 ms": lat["e2e_p50_ms"],
            "e2e p99 ms": lat["e2e_p99_ms"],
            "TTFT p99 ms": lat["ttft_p99_ms"],
            "e2e p99 per window ms": f"{p99[0]:.0f}..{p99[1]:.0f}" if p99 else None,
            "max RSS slope MiB/min": max(slopes) if slopes else None,
            "memory flat": fig["verdict"]["memory_flat"],
            "MemPool balanced": all(w["balanced"] for w in mempool) if mempool else None,
        }
    ]


MEMORY_COLUMNS = {
    "process": "process",
    "role": "role",
    "rss_first_mib": "RSS first MiB",
    "rss_warmup_end_mib": "at warm-up end",
    "rss_end_mib": "at end",
    "rss_max_mib": "peak",
    "growth_after_warmup_mib": "growth after warm-up MiB",
    "slope_mib_per_min": "slope MiB/min",
    "flat": "flat",
    "cpu_s": "CPU s",
}
WINDOW_COLUMNS = {
    "window": "window s",
    "requests": "requests",
    "answers": "answers",
    "errors": "errors",
    "e2e_p50_ms": "e2e p50 ms",
    "e2e_p99_ms": "e2e p99 ms",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
}


def renamed(rows: list[dict[str, Any]], columns: dict[str, str]) -> list[dict[str, Any]]:
    """Each row's `columns` (key -> heading), in that order."""
    return [{heading: row[key] for key, heading in columns.items()} for row in rows]


def notes(fig: dict[str, Any]) -> list[str]:
    c = fig["config"]
    v = fig["verdict"]
    cluster = (
        "one prefill + one decode sim worker (PD, caching-3)"
        if c["pd"]
        else f"{c['workers']} colocated sim workers"
    )
    return [
        f"Cluster: our router (`--policy prompt-tree`) in front of {cluster}, each with "
        f"`--max-total-tokens {c['max_total_tokens']}` (so caches fill and evict all the time) "
        f"and `--time-scale {c['time_scale']:g}`; every process on a free loopback port.",
        f"Load: open loop, Poisson arrivals at {c['rps']:g} requests/s for {c['minutes']:g} "
        f"min ({fig['load']['offered']} requests, {fig['load']['sessions']} multi-turn "
        "sessions of 2-10 turns sharing 6 system prompts, histories resent and growing); "
        f"mix: {', '.join(f'{k} {n}' for k, n in fig['load']['mix'].items())}.",
        f"Aborts: {fig['aborts']['abandoned_streams']} streams abandoned by the client, "
        f"{fig['aborts']['worker_aborted_requests']:g} requests aborted by the workers (a "
        "stream whose answer was complete before the close reached its worker is not "
        "aborted).",
        f"Memory: VmRSS of every process (and any descendant) every {c['sample_secs']:g} s. "
        f"Warm-up is the first {v['warmup_s']:.0f} s; the slope is a {v['fit']}; a process is "
        f"flat when its slope is at most {v['threshold_mib_per_min']:g} MiB/min.",
        prediction_note(fig.get("prediction")),
        "What counts as an unexpected error, how latency and the MemPool balance are taken: "
        "`docs/benchmarks/soak.md`.",
    ]


def prediction_note(p: dict[str, float | None] | None) -> str:
    if p is None:
        return "Routing accuracy: the router's metrics were not read at the end."
    return (
        f"Routing accuracy: the router's prefix trees predicted {p['predicted']:,.0f} cached "
        f"tokens where the workers reported {p['reported']:,.0f} (ratio {p['ratio']}), over "
        "the answers that reported theirs (`memserve_router_predicted_cached_tokens_total`)."
    )


def write(out_dir: Path, fig: dict[str, Any]) -> tuple[Path, Path]:
    c = fig["config"]
    what = "1P1D" if c["pd"] else f"{c['workers']} sim workers"
    title = f"Soak: {c['minutes']:g} min at {c['rps']:g} req/s, our router over {what}"
    body = table_section("Outcomes", fig["outcomes"])
    if fig["errors"]:
        body += table_section("Unexpected errors (first 50)", fig["errors"])
    body += table_section(
        f"Memory per process (verdict: {'flat' if fig['verdict']['memory_flat'] else 'NOT flat'}"
        " after warm-up)",
        renamed(fig["processes"], MEMORY_COLUMNS),
    )
    body += table_section("MemPool accounting after the load", fig["mempool"])
    windows = [{**w, "window": f"{w['t0_s']:g}-{w['t1_s']:g}"} for w in fig["windows"]]
    body += table_section("Latency per window", renamed(windows, WINDOW_COLUMNS))
    gauges = [{"process": name, **dict(sorted(g.items()))} for name, g in fig["gauges_end"].items()]
    body += table_section("Gauges at the end", gauges)
    if fig.get("exited"):
        body += table_section("Processes that exited during the run", fig["exited"])
    body += [f"![latency]({LATENCY_PNG})", "", f"![rss]({RSS_PNG})", ""]
    written = write_results(out_dir, NAME, fig, headline(fig), title, notes(fig), body=body)
    plot_latency(out_dir / LATENCY_PNG, fig)
    plot_rss(out_dir / RSS_PNG, fig)
    return written


def plot_latency(path: Path, fig: dict[str, Any]) -> None:
    rows, c = fig["windows"], fig["config"]
    mids = [(w["t0_s"] + w["t1_s"]) / 2 / 60 for w in rows]
    figure, (top, bottom) = pyplot().subplots(
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
    top.axvline(fig["verdict"]["warmup_s"] / 60, color="0.5", lw=0.8, ls=":", label="warm-up end")
    top.set(yscale="log", ylabel="ms", title="latency per window of request start times")
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    width = (rows[0]["t1_s"] - rows[0]["t0_s"]) / 60 * 0.9 if rows else 0.1
    bottom.bar(mids, [w["requests"] for w in rows], width, color="0.75", label="requests")
    bottom.bar(mids, [w["errors"] for w in rows], width, color="C3", label="unexpected errors")
    bottom.set(ylabel="per window", xlabel="minutes since the load began")
    bottom.legend(fontsize=8)
    figure.suptitle(f"Soak: {c['rps']:g} req/s for {c['minutes']:g} min")
    save(figure, path)


def plot_rss(path: Path, fig: dict[str, Any]) -> None:
    figure, (top, bottom) = pyplot().subplots(
        2, 1, figsize=(10, 7), sharex=True, constrained_layout=True
    )
    v = fig["verdict"]
    slopes = {r["process"]: r["slope_mib_per_min"] for r in fig["processes"]}
    for k, (name, points) in enumerate(sorted(fig["rss_series"].items())):
        slope = slopes.get(name)
        label = f"{name} ({slope:+.2f} MiB/min after warm-up)" if slope is not None else name
        xs = [p[0] / 60 for p in points]
        top.plot(xs, [p[1] for p in points], color=f"C{k % 10}", lw=1.2, label=label)
    top.axvspan(0.0, v["warmup_s"] / 60, color="0.9", zorder=0, label="warm-up")
    verdict = "flat" if v["memory_flat"] else "NOT flat"
    threshold = f"threshold {v['threshold_mib_per_min']:g} MiB/min"
    top.set(
        ylabel="VmRSS (MiB)", title=f"RSS of every process: {verdict} after warm-up ({threshold})"
    )
    top.grid(True, alpha=0.3)
    top.legend(fontsize=7)
    for k, (name, gauges) in enumerate(sorted(fig["gauge_series"].items())):
        key = "tree_pages" if "tree_pages" in gauges else "used_blocks"
        if points := gauges.get(key):
            xs = [p[0] / 60 for p in points]
            ys = [p[1] for p in points]
            bottom.plot(xs, ys, color=f"C{k % 10}", lw=1, label=f"{name} {key}")
    title = "router tree pages and workers' used KV blocks"
    bottom.set(ylabel="pages / blocks", xlabel="minutes since the load began", title=title)
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=7)
    save(figure, path)
