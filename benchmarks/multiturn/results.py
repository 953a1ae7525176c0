"""results.json (one object per run, plus targets and the setup) and results.md (tables)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn import replicas_report
from benchmarks.multiturn.plan import Plan
from benchmarks.multiturn.plots import plot_all
from benchmarks.multiturn.targets import all_targets, foreseen, prediction, ratio_text
from benchmarks.peers import PeerStatus
from benchmarks.report.page import publish
from benchmarks.report.table import markdown_table, percent, rounded
from benchmarks.report.targets import target_rows


def sim_model() -> dict[str, Any]:
    from connector.worker.latency_model import LatencyModel

    model = LatencyModel()
    return {**model.describe(), "kv_capacity_tokens_default": model.kv_capacity_tokens(16)}


def sim_text(model: dict[str, Any]) -> str:
    """The sim's latency model (`sim_model()`) in one phrase, for a results page."""
    return (
        f"{model['model']} on one {model['gpu']}: prefill {model['prefill_per_token_s'] * 1e6:g} "
        f"µs/token + {model['prefill_per_token_pair_s'] * 1e9:g} ns per (new, context) pair, "
        f"decode step {model['decode_weights_s'] * 1e3:g} ms + "
        f"{model['decode_per_context_token_s'] * 1e9:g} ns per context token, "
        f"{model['step_overhead_s'] * 1e3:g} ms per step, KV over {model['interconnect']} "
        f"({model['interconnect_bytes_per_s'] / 1e9:g} GB/s + "
        f"{model['transfer_latency_s'] * 1e6:g} µs per transfer), host tier over "
        f"{model['host_link']} ({model['host_link_bytes_per_s'] / 1e9:g} GB/s + "
        f"{model['host_copy_latency_s'] * 1e6:g} µs per load)"
    )


def run_row(run: dict[str, Any], with_cluster: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"system": run["system"]}
    if run.get("seed") is not None:
        row["seed"] = run["seed"]
    if with_cluster:
        row["cluster"] = f"{run['cluster']} ({run.get('cluster_label') or ''})"
    if not run.get("available"):
        row["note"] = f"not run: {run.get('reason')}"
        return row
    row.update(
        {
            "req": run.get("completed"),
            "err": run.get("errors"),
            "429 retries": run.get("retries_429"),
            "sent/s": rounded(run.get("offered_rps"), 2),
            "TTFT mean": rounded(run.get("ttft_mean_s")),
            "p50": rounded(run.get("ttft_p50_s")),
            "p90": rounded(run.get("ttft_p90_s")),
            "p99": rounded(run.get("ttft_p99_s")),
            "TPOT mean ms": rounded((run.get("tpot_mean_s") or 0) * 1e3, 1)
            if run.get("tpot_mean_s") is not None
            else None,
            "JCT mean": rounded(run.get("jct_mean_s")),
            "JCT p99": rounded(run.get("jct_p99_s")),
            "tok/s": rounded(run.get("output_tokens_per_s"), 0),
            "hit": percent(run.get("hit_ratio"), 1),
            "oracle": percent(run.get("oracle_hit_ratio"), 1),
            "GPU busy": percent(run.get("gpu_utilization"), 1),
            # ours: its trees' cached tokens over the workers' (peers count neither)
            "predicted/reported": ratio_text(prediction(run)),
            "foreseen": percent(foreseen(run), 1),
        }
    )
    if run.get("kv_bytes_moved"):
        row["KV moved GiB"] = rounded(run["kv_bytes_moved"] / 2**30, 2)
    return row


def per_turn_rows(runs: Sequence[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        if run.get("workload") != workload or run.get("group") != "main":
            continue
        if not run.get("available"):
            continue
        turns = run.get("per_turn_ttft_mean_s") or {}
        row: dict[str, Any] = {"system": run["system"]}
        for t, v in turns.items():
            row[f"turn {int(t) + 1}"] = rounded(v)
        rows.append(row)
    return rows


def sections(
    runs: Sequence[dict[str, Any]],
    targets: dict[str, Any],
    replicas: dict[str, Any],
    processes: dict[str, Any] | None = None,
) -> list[str]:
    """The Markdown body: targets, router replicas against one router, then one table per
    workload and cluster group."""
    out = ["## Targets (reported, not asserted)", "", markdown_table(target_rows(targets)), ""]
    out += replicas_report.sections(replicas)
    out += replicas_report.processes_sections(processes or {})
    seen: list[tuple[str, str, str, float]] = []
    for run in runs:
        key = (run["group"], run["cluster"], run["workload"], run["rate"])
        if key not in seen:
            seen.append(key)
    order = {"main": 0, "no_cache": 1, "rate_sweep": 2, "share_ratio": 3, "pd": 4}
    seen.sort(key=lambda k: (order.get(k[0], 9), k[2], k[3]))
    pd_done = False
    for group, cluster, workload, rate in seen:
        if group == "pd":
            if pd_done:
                continue
            pd_done = True
            subset = [r for r in runs if r["group"] == "pd"]
            title = (
                f"### PD: {subset[0]['workload_title']} at {rate:g} req/s, equal instance "
                "counts (MemServe's PD, PD-CC, 1P1D, 1P1D-CC)"
            )
            table = markdown_table([run_row(r, with_cluster=True) for r in subset])
        else:
            subset = [
                r
                for r in runs
                if (r["group"], r["cluster"], r["workload"], r["rate"])
                == (group, cluster, workload, rate)
            ]
            title = f"### {subset[0]['workload_title']}: {cluster}, {rate:g} req/s offered"
            if group == "rate_sweep":
                title += " (rate sweep)"
            table = markdown_table([run_row(r) for r in subset])
        out += [title, "", table, ""]
    for workload in ("multi_round_qa", "sharegpt", "react", "trace"):
        rows = per_turn_rows(runs, workload)
        if rows and len(rows[0]) > 2:
            out += [f"### Per-turn mean TTFT (s): {workload}, 4 colocated", ""]
            out += [markdown_table(rows), ""]
    return out


def peers_text(peers: dict[str, PeerStatus]) -> str:
    """The peers as a note names them: their versions, or why they could not run."""
    return "; ".join(
        f"{name} {s.version}" if s.importable else f"{name}: {s.reason}"
        for name, s in peers.items()
    )


def notes(figures: dict[str, Any], peers: dict[str, PeerStatus]) -> list[str]:
    model, runs = sim_model(), figures["runs"]
    capacity = figures["kv_capacity_tokens"]
    lowered = capacity != model["kv_capacity_tokens_default"]
    workloads: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.get("workload_params") and run["workload"] not in workloads:
            workloads[run["workload"]] = run["workload_params"]
    peer_text = peers_text(peers)
    out = [
        f"Preset: {figures['preset']}. Times in seconds unless marked. TTFT: time to the first "
        "streamed chunk with content; JCT: time to the end of the stream; TPOT: (JCT - TTFT) "
        "/ (completion tokens - 1). `hit`: cached_tokens / prompt_tokens as the workers "
        "report them; `oracle`: the same requests replayed in send order into one infinite "
        "prefix cache (16-token pages, last prompt token always computed): the upper bound.",
        "Workers: `python -m connector.worker --backend sim --tokenizer-cache` (the sim models "
        f"{sim_text(model)}). KV capacity per instance: "
        f"{capacity:,} tokens"
        + (
            " (--max-total-tokens, lowered so eviction shows)"
            if lowered
            else " (90 % of an 80 GB H100 minus the 16 GB of weights, at 128 KiB per token)"
        )
        + ". The same workers serve every system of a cluster; caches are flushed before "
        "each run and each run starts a fresh router. `--time-scale` 1 (modelled H100 time) "
        "except where a cluster's name says otherwise: "
        + "; ".join(f"{name}: {c['time_scale']:g}" for name, c in figures["clusters"].items())
        + " (a time scale of k makes the sim GPU k times slower, so the same request rate "
        "is k times the load; its latencies are wall-clock, k times H100 time).",
        "Clients: one aiohttp session (uvloop), streaming, `temperature` 0, "
        "`ignore_eos`; chat workloads send /v1/chat/completions with the session as the "
        "OpenAI `user` field (our `session` policy sticks by it), the trace sends "
        "/v1/completions text: every router sees text it can route on (sglang-router and "
        "smg match characters, ours tokenizes). Each session is causal: a turn is sent after "
        "the previous answer arrived and carries it. Multi-round QA starts as "
        "production-stack's does: its ramp-up spreads the first users over their rounds, "
        "and their contexts are a warm-up (production-stack's warm-up run), sent through "
        "the system under test and left out of the figures; users who join later start "
        "cold and are measured.",
        f"Peers: {peer_text}. smg runs with --disable-tokenizer-autoload (no downloads); "
        "peers keep their default thresholds.",
        f"Machine: {os.cpu_count()} cores run the client, the router and every worker; the "
        "sim sleeps the modelled GPU time, so CPU contention adds to the latencies.",
    ]
    if any(replicas_report.replicated(r) for r in runs):
        out.append(
            "`ours prompt_tree x2 replicas`: two router processes sharing state through a "
            "private redis-server (no persistence; `--redis-url`, `--replica-id replica-1` "
            "and `replica-2`, `--kv-events-subscribe` where the cluster publishes KV events) "
            "behind `benchmarks/multiturn/front.py` (aiohttp, its own process, the next "
            "replica per request, streams relayed chunk by chunk); the client talks to the "
            "front. The replicas, the front and redis share the machine's cores with "
            "everything else; their CPU seconds are in results.json (`cpu_s`)."
        )
    loads = [r["loadavg_1m"] for r in runs if finite(r.get("loadavg_1m"))]
    if loads:
        out.append(
            f"Machine load at the end of each run (1-minute load average, {os.cpu_count()} "
            f"cores): {min(loads):.1f} to {max(loads):.1f}; a load well above the core count "
            "means something else competed for the CPU during that run."
        )
    for name, params in workloads.items():
        out.append(f"Workload `{name}`: {params_text(params, leave=())}.")
    return out


def params_text(params: dict[str, Any], leave: Sequence[str] = ("seed",)) -> str:
    """A workload's parameters as one line: `name value, ...` (floats shortened)."""
    return ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in params.items()
        if k not in leave
    )


def write_all(
    out_dir: Path,
    plan: Plan | None,
    given: dict[str, Any],
    peers: dict[str, PeerStatus],
) -> None:
    """results.json, results.md and the plots from a run's figures as results.json holds
    them (with `plan`, a new run's: its clusters and KV are added; else an earlier one's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, command, elapsed_s = given["runs"], given.get("command", ""), given.get("elapsed_s", 0.0)
    targets = all_targets(runs)
    replicas = replicas_report.summary(runs)
    processes = replicas_report.processes_summary(runs)
    figures = {
        "preset": given["preset"],
        "command": command,
        "elapsed_s": elapsed_s,
        "runs": runs,
        "targets": targets,
        "replicas": replicas,
        "processes": processes,
        "sim_model": sim_model(),
        "kv_capacity_tokens": given.get("kv_capacity_tokens"),
        "clusters": given.get("clusters") or {},
        "peers": {name: s.__dict__ for name, s in peers.items()},
        "plots": plot_all(out_dir, runs),
    }
    if plan is not None:
        capacity = plan.max_total_tokens or sim_model()["kv_capacity_tokens_default"]
        figures["kv_capacity_tokens"] = capacity
        figures["clusters"] = {name: spec.__dict__ for name, spec in plan.clusters.items()}
    publish(
        out_dir,
        figures,
        "Multi-turn cache benchmarks: policies, peers and PD caching modes",
        [
            f"`{command}` ({elapsed_s / 60:.1f} min).",
            "",
            *sections(runs, targets, replicas, processes),
        ],
        notes(figures, peers),
        given.get("machine") or None,
    )
