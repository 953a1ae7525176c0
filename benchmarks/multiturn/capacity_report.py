"""The capacity preset's figures: paired ratios over seeds, the targets, results.json/.md.

A run is one (workload, working-set multiple, host tier, seed, system). Ratios between two
systems are taken within a seed (the same requests, the same workers) and then summarized
over the seeds as their median and spread (min..max): p99 TTFT against sglang-router's
cache_aware and against the floor, hit ratio against the oracle and against cache_aware.
The hit ratio here counts every reused prompt token: this instance's device and host tiers
and tokens pulled from a peer (`reuse_ratio`).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.capacity import CACHE_AWARE, OURS_WITH_PULLS
from benchmarks.multiturn.capacity_plots import plot_capacity
from benchmarks.multiturn.results import params_text, peers_text, sim_model
from benchmarks.multiturn.targets import (
    foreseen,
    pct,
    prediction,
    ratio_text,
    reasons,
    secs,
    tail_summary,
    with_errors,
)
from benchmarks.peers import PeerStatus
from benchmarks.report.page import publish
from benchmarks.report.seeds import Run, ratio, spread, spread_text
from benchmarks.report.table import markdown_table, rounded
from benchmarks.report.targets import check, target_rows

TARGET_MULTIPLE = 4.0
HIT_VS_ORACLE = 0.9  # ours >= this x the oracle's hit ratio
HIT_VS_CACHE_AWARE = 2.0  # ours >= this x cache_aware's
P99_VS_CACHE_AWARE = 0.5  # ours <= this x cache_aware's p99 TTFT
P99_VS_FLOOR = 1.5  # ours <= this x the floor's p99 TTFT

Config = tuple[str, float, float]  # workload, multiple, host ratio

# name -> (what it is, the value of one run against its seed's cache_aware run or None)
PAIRED: dict[str, tuple[str, Callable[[Run, Run | None], float | None]]] = {
    "hit_vs_oracle": (
        "hit ratio / the oracle's",
        lambda r, ca: ratio(r.get("reuse_ratio"), r.get("oracle_hit_ratio")),
    ),
    "hit_vs_cache_aware": (
        "hit ratio / sglang-router cache_aware's",
        lambda r, ca: None if ca is None else ratio(r.get("reuse_ratio"), ca.get("reuse_ratio")),
    ),
    "p99_vs_cache_aware": (
        "p99 TTFT / sglang-router cache_aware's",
        lambda r, ca: None if ca is None else ratio(r.get("ttft_p99_s"), ca.get("ttft_p99_s")),
    ),
    "p99_vs_floor": (
        "p99 TTFT / the floor's p99",
        lambda r, ca: ratio(r.get("ttft_p99_s"), r.get("floor_ttft_p99_s")),
    ),
}
# figures shown per system and configuration, as their median over the seeds
FIGURES = (
    "reuse_ratio",
    "oracle_hit_ratio",
    "device_share",
    "host_share",
    "pulled_share",
    "recomputed_share",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "floor_ttft_p99_s",
    "kv_pulled_bytes",
    "offered_rps",
    "gpu_utilization",
    "oracle_distinct_tokens",
    "predicted_vs_reported",
    "foreseen_share",
)
# figures of ours' router counters, computed from a run rather than recorded in it
DERIVED: dict[str, Callable[[Run], float | None]] = {
    "predicted_vs_reported": prediction,
    "foreseen_share": foreseen,
}


def _figure(run: Run, key: str) -> Any:
    return DERIVED[key](run) if key in DERIVED else run.get(key)


def config_of(run: Run) -> Config:
    return run["workload"], run["multiple"], run["hicache_ratio"]


def configs(runs: Sequence[Run]) -> list[Config]:
    seen = {config_of(r) for r in runs if "multiple" in r}
    return sorted(seen)


def systems(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in runs))


def runs_of(runs: Sequence[Run], config: Config, system: str) -> dict[int, Run]:
    """seed -> the run of `system` on `config` (available runs only)."""
    return {
        r["seed"]: r
        for r in runs
        if r.get("available") and r["system"] == system and config_of(r) == config
    }


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per configuration and system: the paired ratios per seed with their median and spread,
    and the medians of the figures."""
    out = []
    for config in configs(runs):
        baseline = runs_of(runs, config, CACHE_AWARE.name)
        for system in systems(runs):
            mine = runs_of(runs, config, system)
            if not mine:
                continue
            entry: dict[str, Any] = {
                "workload": config[0],
                "multiple": config[1],
                "hicache_ratio": config[2],
                "system": system,
                "seeds": sorted(mine),
                "errors": sum(
                    (r.get("errors") or 0) + (r.get("warmup_errors") or 0) for r in mine.values()
                ),
                # summed over the seeds (None: runs from before the engines counted them)
                "retracted": _total(mine.values(), "retracted"),
                "engine_aborts": _total(mine.values(), "engine_aborts"),
                "retries_429": sum(r.get("retries_429") or 0 for r in mine.values()),
            }
            for name, (_, value) in PAIRED.items():
                per_seed = {s: value(r, baseline.get(s)) for s, r in mine.items()}
                kept = {s: v for s, v in per_seed.items() if finite(v)}
                entry[name] = {**(spread(list(kept.values())) or {}), "per_seed": kept}
            for key in FIGURES:
                values = [v for r in mine.values() if finite(v := _figure(r, key))]
                entry[key] = statistics.median(values) if values else None
                entry[f"{key}_range"] = [min(values), max(values)] if values else None
            cluster = next(iter(mine.values())).get("cluster_kv_tokens")
            if finite(entry["oracle_distinct_tokens"]) and cluster:
                entry["measured_multiple"] = entry["oracle_distinct_tokens"] / cluster
            out.append(entry)
    return out


def find_entry(
    summary: Sequence[dict[str, Any]], config: Config, system: str
) -> dict[str, Any] | None:
    for e in summary:
        if (e["workload"], e["multiple"], e["hicache_ratio"], e["system"]) == (*config, system):
            return e
    return None


# --------------------------------------------------------------------------- targets


def capacity_targets(runs: Sequence[Run], summary: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """At 4x working set, for each workload, host tier setting and system of ours with pulls:
    hit >= 0.9 oracle, hit >= 2x cache_aware, p99 <= 0.5x cache_aware, p99 <= 1.5x floor."""
    out: dict[str, Any] = {}
    for config in configs(runs):
        workload, multiple, host = config
        if multiple != TARGET_MULTIPLE:
            continue
        where = f"{workload} {multiple:g}x, {'host tier' if host else 'no host tier'}"
        ca = find_entry(summary, config, CACHE_AWARE.name)
        for spec in OURS_WITH_PULLS:
            ours = find_entry(summary, config, spec.name)
            if ours is None:
                continue
            mine = runs_of(runs, config, spec.name)
            theirs = runs_of(runs, config, CACHE_AWARE.name)
            slug = f"{workload}_{multiple:g}x_{'host' if host else 'nohost'}_{spec.policy}"
            for name, op, limit in (
                ("hit_vs_oracle", ">=", HIT_VS_ORACLE),
                ("hit_vs_cache_aware", ">=", HIT_VS_CACHE_AWARE),
                ("p99_vs_cache_aware", "<=", P99_VS_CACHE_AWARE),
                ("p99_vs_floor", "<=", P99_VS_FLOOR),
            ):
                figure = ours.get(name) or {}
                t = check(
                    figure.get("median"), op, limit, f"{where}: {spec.name} {PAIRED[name][0]}"
                )
                t["spread"] = [figure.get("min"), figure.get("max")]
                t["per_seed"] = figure.get("per_seed") or {}
                t["detail"] = detail(name, ours, ca)
                if t["met"] is not True:
                    t["why"] = why(name, ours, ca, mine, theirs)
                involved = [*mine.values(), *(theirs.values() if "cache_aware" in name else ())]
                out[f"{slug}_{name}"] = with_errors(t, involved)
    return out


def split_text(e: dict[str, Any] | None) -> str:
    if e is None:
        return "?"
    return (
        f"{pct(e.get('reuse_ratio'))} reused (device {pct(e.get('device_share'))}, host "
        f"{pct(e.get('host_share'))}, pulled {pct(e.get('pulled_share'))}), recomputed "
        f"{pct(e.get('recomputed_share'))}"
    )


def detail(name: str, ours: dict[str, Any], ca: dict[str, Any] | None) -> str:
    seeds = ", ".join(
        f"seed {s}: {v:.2f}" for s, v in sorted((ours.get(name) or {}).get("per_seed", {}).items())
    )
    if name.startswith("hit"):
        figures = f"ours {split_text(ours)}; oracle {pct(ours.get('oracle_hit_ratio'))}"
        if name == "hit_vs_cache_aware":
            figures += f"; cache_aware {split_text(ca)}"
    else:
        figures = (
            f"p99 ours {secs(ours.get('ttft_p99_s'))}, floor {secs(ours.get('floor_ttft_p99_s'))}"
        )
        if ca is not None:
            figures += f", cache_aware {secs(ca.get('ttft_p99_s'))}"
    return f"{figures} (medians); {seeds}"


def why(
    name: str,
    ours: dict[str, Any],
    ca: dict[str, Any] | None,
    mine: dict[int, Run],
    theirs: dict[int, Run],
) -> str:
    """The figures that explain a miss, from the runs themselves."""
    if not (ours.get(name) or {}).get("per_seed"):
        return "no paired value: " + (
            "sglang-router cache_aware did not run" if not theirs else "a figure is missing"
        )
    run = mine[min(mine)]
    parts: list[str] = []
    if name == "hit_vs_oracle":
        parts.append(
            f"ours {split_text(ours)} against the oracle's {pct(ours.get('oracle_hit_ratio'))}"
        )
        parts.append(capacity_text(run))
        parts.append(f"decisions (seed {run['seed']}): {reasons(run)}")
        parts.append(tier_text(run))
    elif name == "hit_vs_cache_aware":
        parts.append(f"ours {split_text(ours)}; cache_aware {split_text(ca)}")
        parts.append(
            "cache_aware's requests reach the same workers, so the host tier serves its "
            "evicted prefixes too"
            if (ca or {}).get("hicache_ratio")
            else "both lose what the device KV cannot hold"
        )
        parts.append(capacity_text(run))
    else:
        other = theirs.get(run["seed"]) if name == "p99_vs_cache_aware" else None
        parts.append(
            f"p99 ours {secs(ours.get('ttft_p99_s'))} (mean {secs(ours.get('ttft_mean_s'))}), "
            f"floor {secs(ours.get('floor_ttft_p99_s'))}"
            + (f", cache_aware {secs(ca.get('ttft_p99_s'))}" if ca else "")
        )
        parts.append(f"ours' slowest 5% (seed {run['seed']}): {tail_summary(run)}")
        if other is not None:
            parts.append(f"cache_aware's: {tail_summary(other)}")
        parts.append(
            f"hit ours {split_text(ours)}"
            + (f", cache_aware {pct(ca.get('reuse_ratio'))}" if ca else "")
        )
        parts.append(f"GPU busy {pct(ours.get('gpu_utilization'))}")
    return "; ".join(p for p in parts if p)


def capacity_text(run: Run) -> str:
    host = run.get("host_kv_tokens") or 0
    return (
        f"the cluster holds {run.get('cluster_kv_tokens', 0):,} device tokens"
        + (f" + {host:,} host" if host else "")
        + f" for a working set of {run.get('oracle_distinct_tokens', 0):,}"
    )


def tier_text(run: Run) -> str:
    tiers = run.get("tiers") or {}
    if not tiers:
        return "the workers report no tier or pull counters"
    keys = (
        ("pull_pulls", "pulls"),
        ("pull_failures", "failed pulls"),
        ("pull_refused_slower", "pulls refused as slower"),
        ("host_swapped_out_tokens", "tokens swapped out"),
        ("host_swapped_in_tokens", "swapped in"),
        ("host_dropped_tokens", "dropped from host"),
    )
    evicted = sum(w.get("evicted_blocks", 0.0) for w in run.get("per_worker") or [])
    parts = [f"{tiers[k]:,.0f} {label}" for k, label in keys if k in tiers]
    return f"seed {run['seed']}: " + ", ".join([*parts, f"{evicted:,.0f} device blocks evicted"])


# --------------------------------------------------------------------------- Markdown


def ratio_rows(summary: Sequence[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    rows = []
    for e in summary:
        if e["workload"] != workload:
            continue
        row: dict[str, Any] = {
            "multiple": f"{e['multiple']:g}x",
            "host tier": f"{e['hicache_ratio']:g}x" if e["hicache_ratio"] else "no",
            "system": e["system"],
        }
        for name in PAIRED:
            row[name.replace("_", " ")] = spread_text(e.get(name), always=True)
        rows.append(row)
    return rows


def figure_rows(summary: Sequence[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    rows = []
    for e in summary:
        if config_of(e) != config:
            continue
        pulled = e.get("kv_pulled_bytes")
        rows.append(
            {
                "system": e["system"],
                "hit": pct(e.get("reuse_ratio")),
                "oracle": pct(e.get("oracle_hit_ratio")),
                "device": pct(e.get("device_share")),
                "host": pct(e.get("host_share")),
                "pulled": pct(e.get("pulled_share")),
                "recomputed": pct(e.get("recomputed_share")),
                "predicted/reported": ratio_text(e.get("predicted_vs_reported")),
                "foreseen": pct(e["foreseen_share"]) if finite(e.get("foreseen_share")) else None,
                "TTFT mean": rounded(e.get("ttft_mean_s")),
                "p50": rounded(e.get("ttft_p50_s")),
                "p99": rounded(e.get("ttft_p99_s")),
                "floor p99": rounded(e.get("floor_ttft_p99_s")),
                "p99/floor": spread_text(e.get("p99_vs_floor"), always=True),
                "KV pulled GiB": rounded(pulled / 2**30, 2) if finite(pulled) else None,
                "sent/s": rounded(e.get("offered_rps"), 2),
                "GPU busy": pct(e.get("gpu_utilization")),
                "errors": e.get("errors"),
                "aborted": _count(e.get("engine_aborts")),
                "retracted": _count(e.get("retracted")),
                "429 retries": e.get("retries_429"),
            }
        )
    return rows


def _total(runs: Iterable[Run], key: str) -> float | None:
    values = [r[key] for r in runs if finite(r.get(key))]
    return sum(values) if values else None


def _count(value: float | None) -> int | str:
    return int(value) if finite(value) else "n/a"


def config_line(runs: Sequence[Run], config: Config) -> str:
    host = config[2]
    sample = next(r for r in runs if config_of(r) == config)
    measured = [
        r["oracle_distinct_tokens"]
        for r in runs
        if r.get("available") and config_of(r) == config and r.get("oracle_distinct_tokens")
    ]
    cluster = sample["cluster_kv_tokens"]
    text = (
        f"Device KV {sample['instance_kv_tokens']:,} tokens per instance ({cluster:,} in the "
        f"cluster)"
        + (
            f", host tier {host:g}x ({sample['host_kv_tokens']:,} tokens)"
            if host
            else ", no host tier"
        )
        + f"; working set estimated {sample['working_set_sizing']:,} tokens (median of the seeds)"
    )
    if measured:
        m = statistics.median(measured)
        text += (
            f", measured {m:,.0f} (the oracle's pages, median): {m / cluster:.2f}x the device KV"
        )
    return text + "."


def sections(
    runs: Sequence[Run],
    summary: Sequence[dict[str, Any]],
    targets: dict[str, Any],
) -> list[str]:
    seeds = sorted({r["seed"] for r in runs if "seed" in r})
    out = [
        f"## Targets at {TARGET_MULTIPLE:g}x working set (reported, not asserted; medians over "
        f"{len(seeds)} paired seeds)",
        "",
        markdown_table(target_rows(targets)),
        "",
        "## Paired ratios: median [min..max] over the seeds",
        "",
        "Each ratio is taken within a seed (same requests, same workers), then summarized.",
        "",
    ]
    for workload in dict.fromkeys(c[0] for c in configs(runs)):
        out += [f"### {workload}", "", markdown_table(ratio_rows(summary, workload)), ""]
    out += ["## Per configuration (medians over the seeds)", ""]
    for config in configs(runs):
        workload, multiple, host = config
        title = f"### {workload}: working set {multiple:g}x the cluster's device KV, " + (
            f"host tier {host:g}x" if host else "no host tier"
        )
        out += [
            title,
            "",
            config_line(runs, config),
            "",
            markdown_table(figure_rows(summary, config)),
            "",
        ]
    skipped = [r for r in runs if not r.get("available")]
    if skipped:
        out += ["### Not run", ""]
        out += [
            f"- {r['system']} on {r['cluster']} seed {r.get('seed')}: {r.get('reason')}"
            for r in skipped
        ]
        out.append("")
    return out


def notes(
    preset: str,
    runs: Sequence[Run],
    setup: dict[str, Any],
    missing: Sequence[str],
    peers: dict[str, PeerStatus],
) -> list[str]:
    model = sim_model()
    peer_text = peers_text(peers)
    out = [
        f"Preset: {preset}. Times in seconds. `hit`: prompt tokens reused / prompt tokens, "
        "counting every source as the answers report it (`meta_info.cached_tokens_details` "
        "device and host, `pulled_tokens`); `recomputed` is the rest. `oracle`: the same "
        "requests replayed in send order into one infinite prefix cache (16-token pages, "
        "last prompt token always computed).",
        "The floor: each request's TTFT had it run alone with the oracle's cache: the "
        "uncached part prefilled in chunks of the workers' --chunked-prefill-size, one step "
        f"each ({model['step_overhead_s'] * 1e3:g} ms step overhead, "
        f"{model['prefill_per_token_s'] * 1e6:g} µs a token plus "
        f"{model['prefill_per_token_pair_s'] * 1e9:g} ns per (new, context) pair), times the "
        "time scale; `connector/worker/latency_model.py`.",
        "Working set: the distinct tokens the workload caches (prompts and answers, shared "
        "prefixes once, whole pages). Before the run it is estimated by replaying the plan "
        "into the oracle with stand-in answers of the planned lengths; the median over the "
        "seeds sizes the workers' --max-total-tokens so that it is the asked multiple of "
        "the 4 instances' device KV. After each run the oracle's pages give it exactly "
        "(`measured`).",
        "Cluster: 4 colocated sim workers per (workload, multiple, host tier), started once "
        "and shared by every system and seed; caches flushed and a fresh router before each "
        "run; system order rotated per step. Workers run --enable-mempool-pull and publish "
        "KV events on bound ipc:// sockets, to which our router subscribes "
        "(--kv-events-subscribe; the peers do not listen); our router starts only after its "
        "trees are synchronized with the flushed caches.",
        f"Peers: {peer_text}; defaults, as in the main preset.",
        f"Machine: {os.cpu_count()} cores run the client, the router and every worker; the "
        "sim sleeps the modelled GPU time, so CPU contention adds to the latencies.",
    ]
    out += [f"Left out: {m}" for m in missing]
    unsynced = [r for r in runs if r.get("events_synced") is False]
    if unsynced:
        out.append(
            f"{len(unsynced)} runs of ours started before every worker's clear event reached "
            "the router (their trees may have begun with stale entries): "
            + "; ".join(f"{r['system']} on {r['cluster']} seed {r['seed']}" for r in unsynced)
        )
    for name, s in setup.items():
        out.append(
            f"Workload `{name}`: time scale {s['time_scale']:g}; working set estimates per "
            f"seed {s['working_set_estimates']}; largest request {s['largest_request_tokens']:,} "
            f"tokens; device KV per instance by multiple {s['instance_kv_tokens']}."
        )
    params: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.get("workload_params") and run["workload"] not in params:
            params[run["workload"]] = run["workload_params"]
    for name, p in params.items():
        out.append(f"Workload `{name}` (seed {p.get('seed')}): {params_text(p)}.")
    return out


def write_capacity(
    out_dir: Path,
    preset: str,
    runs: list[Run],
    setup: dict[str, Any],
    missing: Sequence[str],
    peers: dict[str, PeerStatus],
    elapsed_s: float,
    command: str,
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    targets = capacity_targets(runs, summary)
    plots = plot_capacity(out_dir, summary)
    figures = {
        "preset": preset,
        "command": command,
        "elapsed_s": elapsed_s,
        "runs": runs,
        "summary": summary,
        "targets": targets,
        "setup": setup,
        "missing": list(missing),
        "sim_model": sim_model(),
        "peers": {name: s.__dict__ for name, s in peers.items()},
        "plots": plots,
    }
    publish(
        out_dir,
        figures,
        "Multi-turn capacity-bound benchmark: caches smaller than the working set",
        [
            f"`{command}` ({elapsed_s / 60:.1f} min, {len(runs)} runs).",
            "",
            *sections(runs, summary, targets),
        ],
        notes(preset, runs, setup, missing, peers),
        machine,
    )
    return figures
