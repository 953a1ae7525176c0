"""The result files: JSON, a Markdown page (the headline table of added latency and max rps,
the detail tables, notes on how each figure was taken) and the plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.report.figures import pyplot, save
from benchmarks.report.page import write_results
from benchmarks.report.table import rounded, table_section
from benchmarks.router_overhead.figures import Figure, find, router_cpu_us
from benchmarks.router_overhead.profile import section as profile_section
from benchmarks.router_overhead.settings import (
    NAME,
    RPS_MAX_TOKENS,
    SMALL_MAX_TOKENS,
    TARGET_MULTI_TURN_ADDED_P50_MS,
    WORKLOAD_TITLES,
    WORKLOADS,
    Settings,
)

INTERNAL = [  # (row, part of the figures, key, unit)
    ("select(), 8K request, prefix held (hit)", "decision", "select_hit_us", "µs"),
    ("select(), 8K request, new chat (miss)", "decision", "select_miss_us", "µs"),
    ("select(), hit, tokens passed as a Python list", "decision", "select_hit_list_us", "µs"),
    ("  of which list -> uint32 array", "decision", "list_to_uint32_us", "µs"),
    ("uint32 array -> list (encoder's tolist)", "decision", "uint32_to_list_us", "µs"),
    ("tree record(), 8K path held", "decision", "record_8k_us", "µs"),
    ("ChatTokenizer.encode_chat, 8K (full)", "tokenizer", "full_encode_ms", "ms"),
    ("  of which chat template render", "tokenizer", "render_ms", "ms"),
    ("the router's encode, cold (new 8K chat)", "tokenizer", "cached_cold_ms", "ms"),
    ("the router's encode, warm (turn 2)", "tokenizer", "cached_warm_ms", "ms"),
]


def latency_rows(fig: Figure) -> list[Figure]:
    """The headline table: added latency per system and workload (the baseline's own in
    parentheses), and max rps."""
    rows = []
    for s in fig["systems"]:
        row: Figure = {"system": s["name"]}
        if not s["available"]:
            rows.append({**row, "note": f"skipped: {s['reason']}"})
            continue
        base = s["kind"] == "baseline"
        for w in WORKLOADS:
            for q in ("p50", "p99"):
                value = s["latency_ms" if base else "added_ms"][w][q]
                row[f"{w} {q} ms"] = f"({value:.2f})" if base else rounded(value)
        row["max rps"] = round(s["rps"]["rps"], 1) if s["rps"] else None
        row["note"] = "end-to-end latency, not added" if base else ""
        rows.append(row)
    return rows


def absolute_row(s: Figure) -> Figure:
    """End-to-end latency per workload, and under the max rps load."""
    row: Figure = {"system": s["name"]}
    for w in WORKLOADS:
        row |= {f"{w} {q}": rounded(s["latency_ms"][w][q]) for q in ("p50", "p99")}
    if s["rps"]:
        row |= {f"at max rps {q}": rounded(s["rps"]["latency_ms"][q]) for q in ("p50", "p99")}
    return row


def paired_row(s: Figure) -> Figure:
    """Paired added p50 (drift-proof), the workers' cache hits, request and error counts."""
    row: Figure = {"system": s["name"]}
    for w in WORKLOADS:
        paired = None if s["kind"] == "baseline" else s["added_paired_ms"][w]["p50"]
        row[f"{w} paired added p50 ms"] = rounded(paired)
    for w in WORKLOADS:
        cached = s["worker_cached_fraction"][w]
        row[f"{w} cached"] = f"{cached:.0%}" if cached is not None else None
    row["requests"] = sum(s["requests"].values())
    row["errors"] = sum(s["errors"].values())
    row["rps errors"] = s["rps"]["errors"] if s["rps"] else None
    return row


def target_row(name: str, t: Figure) -> Figure:
    """Beside the shared columns, the plain p50 difference the paired figure cross-checks."""
    value, difference = t["value"], t.get("p50_difference")
    return {
        "target": name,
        "value": float(f"{value:.4g}") if finite(value) else value,
        "p50 difference": float(f"{difference:.4g}") if finite(difference) else None,
        "limit": f"{t['op']} {t['limit']:.4g}",
        "met": t["met"],
        "about": t["about"],
        "why missed": t.get("why", ""),
    }


def cpu_rows(fig: Figure) -> list[Figure]:
    """Per router: its own CPU per request at max rps, the cores it kept busy, and both
    against sglang-router cache_aware's on the same set."""
    rows = []
    for s in fig["systems"]:
        mine = router_cpu_us(s)
        if s["kind"] == "baseline" or not s["available"] or mine is None:
            continue
        peer = router_cpu_us(find(fig, "sglang-router", "cache_aware", s["cores"]))
        row = {
            "system": s["name"],
            "router CPU us/request": mine,
            "router cores busy": s["rps"]["router_cpu_s"] / s["rps"]["duration_s"],
            "x sglang-router cache_aware's": mine / peer if peer else None,
            "rps one core would serve": 1e6 / mine,
        }
        rows.append({k: rounded(v) for k, v in row.items()})
    return rows


def write(out_dir: Path, fig: Figure, settings: Settings) -> None:
    """The JSON and the page via the shared writer (the extra tables go before its notes),
    then the plot."""
    live = [s for s in fig["systems"] if s["available"]]
    write_results(
        out_dir,
        NAME,
        fig,
        latency_rows(fig),
        "Router overhead: latency added over direct-to-worker, and max requests/s",
        notes(fig, settings),
        machine=fig.get("machine"),  # a page rebuilt from its JSON keeps the run's stamp
        body=[
            *table_section("End-to-end latency (ms)", [absolute_row(s) for s in live]),
            *table_section(
                "Paired added latency and the workers' cache hits", [paired_row(s) for s in live]
            ),
            *table_section(
                "Inside our router (in process, no HTTP)",
                [
                    {"figure": row, **fig[part][key], "unit": unit}
                    for row, part, key, unit in INTERNAL
                ],
            ),
            *table_section(
                "Targets (reported, not asserted)",
                [target_row(name, t) for name, t in fig["targets"].items()],
            ),
            *table_section(
                "max rps ratios (the same CPU set)",
                [{"ratio": k, "value": v} for k, v in fig["rps_ratio"].items()],
            ),
            *table_section(
                "Max rps per core, and from 1 core to more",
                [{k: rounded(v, 2) for k, v in row.items()} for row in fig["scaling"]],
            ),
            *table_section(
                "The router's own CPU per request, in the max rps windows", cpu_rows(fig)
            ),
            *profile_section(fig.get("profile")),
        ],
    )
    plot(out_dir / f"{NAME}.png", fig)


def notes(fig: Figure, settings: Settings) -> list[str]:
    wl, dec, peer = fig["workloads"], fig["decision"], fig["peer"]
    peers = ", ".join(f"{n} {p['version'] or '(not importable)'}" for n, p in fig["peers"].items())
    skipped = "" if fig["peer_available"] else f" ({peer['package']} skipped: {peer['reason']})"
    return [
        f"Mode: {fig['mode']}; elapsed {fig['elapsed_s']:.0f} s. Targets are reported, not "
        "asserted. The first table's router rows are *added* latency (ms): the system's p50 "
        "(p99) minus the direct baseline's over the same requests; the baseline row is its own "
        "latency, in parentheses. The latency targets use the paired added p50: the median of "
        "per-request differences to the baseline's same request, taken moments apart, which "
        "the workers' jitter does not move (the plain p50 difference beside it).",
        "Systems: 2 sim workers (`connector.worker --backend sim --time-scale 0`) behind every "
        "one; direct = every latency request to worker 1 (rps: to both in turn). `@Cc`: the "
        "router pinned to the last C of the CPUs the benchmark may use (sets of "
        f"{', '.join(map(str, fig['core_counts']))}); the workers and the client are not "
        "pinned. `Np`: ours with --processes N (one port, one shared state); the peers' "
        f"runtimes use every core of their set, with their defaults. Peers: {peers}{skipped}.",
        f"Latency: one client (aiohttp, uvloop), sequential, non-streaming, max_tokens "
        f"{SMALL_MAX_TOKENS}; each small chat and each 8K conversation goes through every "
        "system in an order drawn per request (seeded), worker caches (KV and token cache) "
        "flushed before each conversation. small: "
        f"{settings.small_requests} chats of ~{_fmt(wl['small_prompt_tokens_p50'])} tokens. "
        f"cold_8k: turn 1 of {settings.conversations} conversations (p50 "
        f"{_fmt(wl['cold_8k_prompt_tokens_p50'])} tokens: a shared "
        f"{_fmt(wl['system_prompt_tokens'])}-token system prompt, then 220-340 words a message "
        f"of seeded prose). multi_turn: turns 2..{settings.turns} (the worker's answer sent "
        f"back, then a new ~25-word question; p50 {_fmt(wl['multi_turn_prompt_tokens_p50'])} "
        "tokens). shared_text: turn 1 as one text with a question, sent to /v1/completions, "
        "then again with another question, which is timed. `cached`: the workers' "
        "cached_tokens / prompt_tokens.",
        f"max rps: {settings.concurrency} clients in one process, small chats, max_tokens "
        f"{RPS_MAX_TOKENS}, {settings.rps_duration_s:g} s counted per system in "
        f"{settings.rps_slices} slices interleaved across systems (each: fresh connections, "
        f"{settings.rps_warmup_s:g} s uncounted warm-up). The client, the workers and the "
        f"router share this machine's {os.cpu_count()} cores: on the largest set it is the "
        "whole box's throughput.",
        "Router CPU per request: user + system time of all the router's processes from /proc "
        "over the counted windows, per request completed: the router's own cost, which the "
        "client and workers do not move (1e6 / it: what one core would serve). `python floor` "
        "(floor_proxy.py) only parses, forwards over the router's pooled connections and "
        "writes back: what any Python router spends at least.",
        f"Decision time: in process, PromptTree.select over trees holding "
        f"{dec['tree_conversations']} 8K chats on {dec['tree_workers']} workers "
        f"({dec['tree_pages']:,} pages); hit = turn 2 of a held chat, miss = a new chat; "
        f"{dec['calls']} calls each, tokens as the router's uint32 array (the list row: what "
        f"Python lists would cost). Tokenizer: {fig['tokenizer']['conversations']} 8K chats; "
        "full = render + encode (what the worker does); the router's encode cold = a new chat "
        "(system prompt cached), warm = its turn 2.",
    ]


def _fmt(value: Any) -> str:
    return f"{value:,.0f}" if finite(value) else "?"


def plot(path: Path, fig: Figure) -> None:
    """(a) the latency each router adds per workload, (b) max requests/s per system."""
    plt = pyplot()
    systems = [s for s in fig["systems"] if s["available"]]
    routers = [s for s in systems if s["kind"] != "baseline"]
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(15, 5.2), constrained_layout=True, gridspec_kw={"width_ratios": [2, 1.2]}
    )
    width = 0.8 / max(len(routers), 1)
    for k, s in enumerate(routers):
        xs = [i + (k - (len(routers) - 1) / 2) * width for i in range(len(WORKLOADS))]
        p50, p99 = ([s["added_ms"][w][q] for w in WORKLOADS] for q in ("p50", "p99"))
        left.bar(xs, p50, width * 0.9, color=f"C{k}", label=f"{s['name']} (bar: p50)")
        left.plot(xs, p99, "_", color="k", ms=14, mew=2, label="p99" if k == 0 else None)
    left.axhline(0, color="k", lw=0.6)
    target = TARGET_MULTI_TURN_ADDED_P50_MS
    label = f"multi-turn target p50 {target:g} ms"
    left.plot([2 - 0.45, 2 + 0.45], [target] * 2, "k--", lw=1, label=label)
    left.set_xticks(range(len(WORKLOADS)), [WORKLOAD_TITLES[w] for w in WORKLOADS])
    left.set_ylabel("added latency vs direct (ms)")
    left.set_title("(a) latency a router adds (bars p50, black ticks p99)")
    left.legend(fontsize=7, ncol=2)

    measured = [s for s in systems if s["rps"]]
    colors = ["0.5"] + [f"C{k}" for k in range(len(measured) - 1)]
    bars = right.bar(range(len(measured)), [s["rps"]["rps"] for s in measured], color=colors)
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    names = [s["name"].replace(" ", "\n", 1) for s in measured]
    right.set_xticks(range(len(measured)), names, fontsize=6, rotation=45)
    right.set_ylabel("requests/s")
    concurrency = fig["config"]["settings"]["concurrency"]
    right.set_title(f"(b) max rps, {concurrency} clients, max_tokens {RPS_MAX_TOKENS}")
    for axes in (left, right):
        axes.grid(True, axis="y", alpha=0.3)
    figure.suptitle("Router overhead over 2 sim workers (--time-scale 0)")
    save(figure, path, dpi=120)
