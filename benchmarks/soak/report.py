"""results.json and results.md: the headline, outcomes, memory per process, MemPool
accounting, latency per window, and notes that say how each figure was taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.page import write_results
from benchmarks.report.table import table_section

NAME = "results"
LATENCY_PNG = "latency.png"
RSS_PNG = "rss.png"


def headline(fig: dict[str, Any]) -> list[dict[str, Any]]:
    lat = fig["latency"]
    verdict = fig["verdict"]
    p99 = fig["e2e_p99_range_ms"]
    slopes = [
        r["slope_mib_per_min"] for r in fig["processes"] if r["slope_mib_per_min"] is not None
    ]
    balanced = all(w["balanced"] for w in fig["mempool"]) if fig["mempool"] else None
    return [
        {
            "requests": fig["load"]["offered"],
            "unexpected errors": fig["unexpected_errors"],
            "e2e p50 ms": lat["e2e_p50_ms"],
            "e2e p99 ms": lat["e2e_p99_ms"],
            "TTFT p99 ms": lat["ttft_p99_ms"],
            "e2e p99 per window ms": f"{p99[0]:.0f}..{p99[1]:.0f}" if p99 else None,
            "max RSS slope MiB/min": max(slopes) if slopes else None,
            "memory flat": verdict["memory_flat"],
            "MemPool balanced": balanced,
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


def window_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{**w, "window": f"{w['t0_s']:g}-{w['t1_s']:g}"} for w in fig["windows"]]
    return renamed(rows, WINDOW_COLUMNS)


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
        "Expected outcomes, not errors: deliberately malformed requests answered 400 with a "
        "JSON error (`bad_request_rejected`), and streams the client closes after their first "
        "chunk (`abandoned`). Everything else that is not a complete answer (a stream ending "
        "in [DONE] after a finish reason; a body with its text and finish reason) is an "
        "unexpected error, kept with its status and body.",
        f"Aborts: {fig['aborts']['abandoned_streams']} streams abandoned by the client, "
        f"{fig['aborts']['worker_aborted_requests']:g} requests aborted by the workers (a "
        "stream whose answer was complete before the close reached its worker is not "
        "aborted).",
        "Latency: end to end of every complete answer, TTFT (first chunk with content) of "
        "complete streams, per window of request start times; nearest-rank percentiles.",
        f"Memory: VmRSS of every process (and any descendant) every {c['sample_secs']:g} s. "
        f"Warm-up is the first {v['warmup_s']:.0f} s; the slope is a {v['fit']}; a process is "
        f"flat when its slope is at most {v['threshold_mib_per_min']:g} MiB/min.",
        "MemPool accounting, once the load stopped: each worker's allocated blocks (every "
        "tier) equal the blocks its index holds and no page is pinned, polled for up to "
        "30 s while aborts and write-backs finish (the tests' `no_leak`).",
        f"Plots: [{LATENCY_PNG}]({LATENCY_PNG}) (latency percentiles per window), "
        f"[{RSS_PNG}]({RSS_PNG}) (RSS of every process, and the cache gauges).",
    ]


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
    body += table_section("Latency per window", window_rows(fig))
    gauges = [{"process": name, **dict(sorted(g.items()))} for name, g in fig["gauges_end"].items()]
    body += table_section("Gauges at the end", gauges)
    if fig.get("exited"):
        body += table_section("Processes that exited during the run", fig["exited"])
    body += [f"![latency]({LATENCY_PNG})", "", f"![rss]({RSS_PNG})", ""]
    return write_results(out_dir, NAME, fig, headline(fig), title, notes(fig), body=body)
