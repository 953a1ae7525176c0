"""The Markdown report: the headline table of added latency and max rps, the detail
tables, and notes that say how every figure was taken."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.report.page import write_results
from benchmarks.report.table import rounded, table_section
from benchmarks.router_overhead.figures import cpu_rows
from benchmarks.router_overhead.profile import section as profile_section
from benchmarks.router_overhead.settings import (
    NAME,
    RPS_MAX_TOKENS,
    SMALL_MAX_TOKENS,
    WORKLOADS,
    Settings,
)


def latency_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline table: added latency per system and workload, and max rps."""
    rows = []
    for s in fig["systems"]:
        row: dict[str, Any] = {"system": s["name"]}
        if not s["available"]:
            row["note"] = f"skipped: {s['reason']}"
            rows.append(row)
            continue
        for w in WORKLOADS:
            added = s["added_ms"][w]
            if s["kind"] == "baseline":
                lat = s["latency_ms"][w]
                row[f"{w} p50 ms"] = f"({lat['p50']:.2f})"
                row[f"{w} p99 ms"] = f"({lat['p99']:.2f})"
            else:
                row[f"{w} p50 ms"] = rounded(added["p50"])
                row[f"{w} p99 ms"] = rounded(added["p99"])
        row["max rps"] = round(s["rps"]["rps"], 1) if s["rps"] else None
        row["note"] = "end-to-end latency, not added" if s["kind"] == "baseline" else ""
        rows.append(row)
    return rows


def absolute_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """End-to-end latency per system (the baseline's included) and under the rps load."""
    return [absolute_row(s) for s in fig["systems"] if s["available"]]


def absolute_row(s: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"system": s["name"]}
    for w in WORKLOADS:
        lat = s["latency_ms"][w]
        row[f"{w} p50"] = rounded(lat["p50"])
        row[f"{w} p99"] = rounded(lat["p99"])
    if s["rps"]:
        row["at max rps p50"] = rounded(s["rps"]["latency_ms"]["p50"])
        row["at max rps p99"] = rounded(s["rps"]["latency_ms"]["p99"])
    return row


def paired_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """Paired added p50 (drift-proof), the workers' cache hits, request and error counts."""
    return [paired_row(s) for s in fig["systems"] if s["available"]]


def paired_row(s: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"system": s["name"]}
    baseline = s["kind"] == "baseline"
    for w in WORKLOADS:
        paired = None if baseline else s["added_paired_ms"][w]["p50"]
        row[f"{w} paired added p50 ms"] = rounded(paired)
    for w in WORKLOADS:
        cached = s["worker_cached_fraction"][w]
        row[f"{w} cached"] = f"{cached:.0%}" if cached is not None else None
    row["requests"] = sum(s["requests"].values())
    row["errors"] = sum(s["errors"].values())
    row["rps errors"] = s["rps"]["errors"] if s["rps"] else None
    return row


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


def internal_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"figure": row, **_pair(fig[part][key], unit)} for row, part, key, unit in INTERNAL]


def _pair(values: dict[str, float], unit: str) -> dict[str, Any]:
    return {"p50": values["p50"], "p99": values["p99"], "unit": unit}


def target_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, t in fig["targets"].items():
        value = t["value"]
        rows.append(
            {
                "target": name,
                "value": value if not finite(value) else float(f"{value:.4g}"),
                "p50 difference": float(f"{t['p50_difference']:.4g}")
                if finite(t.get("p50_difference"))
                else None,
                "limit": f"{t['op']} {t['limit']:.4g}",
                "met": t["met"],
                "about": t["about"],
                "why missed": t.get("why", ""),
            }
        )
    return rows


def scaling_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: rounded(v, 2) for k, v in row.items()} for row in fig["scaling"]]


def write(out_dir: Path, fig: dict[str, Any], settings: Settings) -> None:
    """JSON and Markdown via the harness; the extra tables go before its notes."""
    ratios = [{"ratio": k, "value": v} for k, v in fig["rps_ratio"].items()]
    write_results(
        out_dir,
        NAME,
        fig,
        latency_rows(fig),
        "Router overhead: latency added over direct-to-worker, and max requests/s",
        notes(fig, settings),
        machine=fig.get("machine"),  # a page rebuilt from its JSON keeps the run's stamp
        body=[
            *table_section("End-to-end latency (ms)", absolute_rows(fig)),
            *table_section("Paired added latency and the workers' cache hits", paired_rows(fig)),
            *table_section("Inside our router (in process, no HTTP)", internal_rows(fig)),
            *table_section("Targets (reported, not asserted)", target_rows(fig)),
            *table_section("max rps ratios (the same CPU set)", ratios),
            *table_section("Max rps per core, and from 1 core to more", scaling_rows(fig)),
            *table_section(
                "The router's own CPU per request, in the max rps windows",
                [{k: rounded(v) for k, v in row.items()} for row in cpu_rows(fig)],
            ),
            *profile_section(fig.get("profile")),
        ],
    )


def notes(fig: dict[str, Any], settings: Settings) -> list[str]:
    wl = fig["workloads"]
    peer = fig["peer"]
    out = [
        f"Mode: {fig['mode']}; elapsed {fig['elapsed_s']:.0f} s. Targets are reported, not "
        "asserted. Latencies in ms; the first table's router rows are *added* latency: the "
        "system's p50 (p99) minus the direct baseline's p50 (p99) over the same requests; "
        "the baseline row shows its own end-to-end latency in parentheses. The latency "
        "targets use the paired added p50 (below), which the workers' own jitter (several ms "
        "on an 8K chat, drifting with the VM) does not move; the plain p50 difference is "
        "shown beside it.",
        "Workers: 2 sim workers (`python -m connector.worker --backend sim --time-scale 0`), "
        "the same processes behind every system. Direct = every latency request to worker 1 "
        "(rps: the client alternates between both workers).",
        "Systems: `@Cc`: the router pinned to C cores with taskset (the last C of the CPUs "
        f"the benchmark may use; sets of {', '.join(map(str, fig['core_counts']))}); the "
        "workers and the client are not pinned and share the machine. `Np`: ours with "
        "--processes N (N router processes on one port, sharing one state); the peers' "
        "runtimes use every core of their set. Peers: "
        + ", ".join(
            f"{name} {info['version'] or '(not importable)'}" for name, info in fig["peers"].items()
        )
        + ".",
        f"Latency: one client (aiohttp, uvloop), sequential, non-streaming, max_tokens "
        f"{SMALL_MAX_TOKENS}. Systems interleaved: each small chat goes through every system "
        "in turn, and each 8K conversation (all its turns) likewise, in an order rotated per "
        "request or conversation; worker caches are flushed before each system's run of a "
        "conversation, so every system sees the same requests in the same worker state. "
        "`paired added p50`: the median of per-request differences to the baseline (the same "
        "request, taken moments apart), a drift-proof cross-check of the p50 difference.",
        f"small: {settings.small_requests} distinct chats, ~{_fmt(wl['small_prompt_tokens_p50'])} "
        f"prompt tokens. cold_8k: turn 1 of {settings.conversations} new conversations "
        f"(p50 {_fmt(wl['cold_8k_prompt_tokens_p50'])} tokens: a shared "
        f"{_fmt(wl['system_prompt_tokens'])}-token system prompt, then user/assistant "
        "messages of 220-340 words of seeded English-like prose). "
        f"multi_turn: turns 2..{settings.turns} of each (history + the answer the worker "
        f"gave, {SMALL_MAX_TOKENS} tokens, sent back as a chat client does + a new ~25-word user "
        "message; p50 "
        f"{_fmt(wl['multi_turn_prompt_tokens_p50'])} tokens). "
        "shared_text: per conversation, its first turn's messages as one text (a document or "
        "a tool prompt) and a question, sent twice to /v1/completions with another question "
        "the second time; the second is timed (the document was seen once, the question is "
        "new).",
        "`cached` columns: the workers' reported cached_tokens / prompt_tokens, i.e. how well "
        "the routing kept a conversation on the worker holding its history.",
        f"max rps: {settings.concurrency} concurrent clients in one process (aiohttp, uvloop), "
        f"small chats, non-streaming, max_tokens {RPS_MAX_TOKENS}, "
        f"{settings.rps_duration_s:g} s counted per system, run as {settings.rps_slices} "
        "slices interleaved across systems in a rotated order (each slice: fresh connections, "
        f"{settings.rps_warmup_s:g} s warm-up uncounted, then completions inside the window "
        "counted). The client and both workers (not pinned) and the router (pinned to its "
        f"set) share this machine's {os.cpu_count()} cores: on the smallest set the router "
        "has one core at most, on the largest it competes with the client and the workers "
        "for every core, so that figure is the throughput of the whole box.",
        "Router CPU per request: user + system time of the router's processes (all of "
        "them: ours with --processes N, a peer's runtime threads), read from /proc at the "
        "start and end of each counted window, over the requests completed in it. It is the "
        "router's own cost, which the client and workers sharing the box do not move; "
        "1e6 / it is what one core of the router would serve if nothing else ran there. "
        "`python floor` (benchmarks/router_overhead/floor_proxy.py) is a reference, not a "
        "router: it parses each request with httptools, sends the body to the next worker "
        "over the router's own pooled connections and writes the answer back, nothing else "
        "(no JSON, tokenizer, tree, metrics or retries): what any Python router spends at "
        "least.",
        f"Decision time: in process, PromptTree.select over PromptTrees holding "
        f"{fig['decision']['tree_conversations']} 8K chats (turn 1 + reply) spread over "
        f"{fig['decision']['tree_workers']} workers ({fig['decision']['tree_pages']:,} pages); "
        "hit = turn 2 of a held chat, miss = a new chat sharing only the system prompt; "
        f"{fig['decision']['calls']} calls each. Tokens are passed as the router passes them "
        "(the uint32 array its token cache assembles); the list row is what an engine passing "
        "Python lists would pay, the conversion inside select().",
        f"Tokenizer: {fig['tokenizer']['conversations']} 8K chats. full = "
        "ChatTokenizer.encode_chat (render + encode, what the worker does); CachedEncoder "
        "cold = a new chat with the system prompt already cached (what a running router "
        "sees); warm = turn 2 of that chat.",
        f"Peer: {peer['package']} "
        + (
            f"{peer['version']}"
            if fig["peer_available"]
            else f"skipped ({fig['peer']['reason'] or 'not available'})"
        )
        + "; run with its defaults plus --log-level warn and its own free prometheus port.",
    ]
    return out


def _fmt(value: Any) -> str:
    return f"{value:,.0f}" if finite(value) else "?"
