"""The figures of a paired preset (`--hot-prefix`, `--pd`): per config and system, medians
and spreads over the seeds, the targets, results.json and results.md.

A run is one (config, seed, system on a member cluster). Systems are named with their
workers' caching mode on PD clusters (`paired.system_label`). Ratios between two systems
are taken within a seed (the same requests on workers of the same shape and KV) and then
summarized as their median and min..max over the seeds. Per worker, the share of the
requests and of the busy (modelled GPU) time is taken among the workers of its role: a
prefill against the prefills, a decode against the decodes.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.paired import system_label
from benchmarks.multiturn.paired_plots import plot_paired
from benchmarks.multiturn.results import params_text, peers_text, sim_model, sim_text
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
from benchmarks.report.seeds import Run, configs, ratio, spread, spread_text
from benchmarks.report.table import markdown_table, rounded, table_section
from benchmarks.report.targets import check, target_rows

FLOOR = "floor"  # a Target's `other`: the run's own floor


def label(run: Run) -> str:
    return system_label(run["system"], run.get("pd_caching"))


def roles(run: Run) -> list[str]:
    """Each worker's role (colocated, prefill, decode); colocated where the run has none."""
    return run.get("worker_roles") or ["colocated"] * len(run.get("per_worker") or [])


def role_groups(run: Run) -> dict[str, list[int]]:
    """Worker indices by role."""
    groups: dict[str, list[int]] = {}
    for i, role in enumerate(roles(run)):
        groups.setdefault(role, []).append(i)
    return groups


def shares(run: Run, values: Sequence[float]) -> list[float | None]:
    """Each worker's value as a share of its role's total."""
    out: list[float | None] = [None] * len(values)
    for members in role_groups(run).values():
        total = sum(values[i] for i in members)
        for i in members:
            out[i] = values[i] / total if total else None
    return out


def request_shares(run: Run) -> list[float | None]:
    return shares(run, [w.get("requests", 0.0) for w in run.get("per_worker") or []])


def busy_shares(run: Run) -> list[float | None]:
    return shares(run, list(run.get("gpu_busy_s") or []))


def busy_balance(run: Run) -> float | None:
    """The least busy worker's busy time over its role's mean (1: even; < 0.5: a worker
    had less than half the mean share), the lowest over the roles."""
    busy = list(run.get("gpu_busy_s") or [])
    lows = []
    for members in role_groups(run).values():
        mean = statistics.fmean(busy[i] for i in members) if members else 0.0
        if mean > 0 and len(members) > 1:
            lows.append(min(busy[i] for i in members) / mean)
    return min(lows) if lows else None


def kv_moved(run: Run) -> dict[str, float]:
    """Modelled KV bytes moved: prefill to decode (PD transfers), decode to prefill
    (write-backs) and pulled between colocated peers; write-backs completed."""
    by_role = {"prefill": 0.0, "decode": 0.0}
    writebacks = 0.0
    for role, worker in zip(roles(run), run.get("per_worker") or [], strict=True):
        if role in by_role:
            by_role[role] += worker.get("pd_bytes_sent", 0.0)
        writebacks += worker.get("written_back", 0.0)
    return {
        "kv_pd_bytes": by_role["prefill"],
        "kv_writeback_bytes": by_role["decode"],
        "kv_pulled_bytes": float(run.get("kv_pulled_bytes") or 0.0),
        "writebacks": writebacks,
    }


def derived(run: Run) -> dict[str, Any]:
    """A run's figures the report adds to what it recorded."""
    cpu = sum((run.get("cpu_s") or {}).values())
    return {
        **kv_moved(run),
        "hit_vs_oracle": ratio(run.get("reuse_ratio"), run.get("oracle_hit_ratio")),
        "p99_vs_floor": ratio(run.get("ttft_p99_s"), run.get("floor_ttft_p99_s")),
        "queue_floor_vs_floor": ratio(
            run.get("queue_floor_ttft_p99_s"), run.get("floor_ttft_p99_s")
        ),
        "busy_balance": busy_balance(run),
        # client, routers and workers: what the time scale must leave room for on 2 cores
        "cpu_ms_per_request": ratio(cpu * 1e3, run.get("requests")),
        "predicted_vs_reported": prediction(run),
        "foreseen_share": foreseen(run),
    }


# figures summarized per system as their median over the seeds
FIGURES = (
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "floor_ttft_p99_s",
    "p99_vs_floor",
    "queue_floor_ttft_p99_s",
    "queue_floor_vs_floor",
    "lru_queue_floor_ttft_p99_s",
    "jct_mean_s",
    "jct_p99_s",
    "reuse_ratio",
    "oracle_hit_ratio",
    "lru_hit_ratio",
    "device_share",
    "host_share",
    "pulled_share",
    "written_back_share",
    "recomputed_share",
    "kv_pd_bytes",
    "kv_writeback_bytes",
    "kv_pulled_bytes",
    "writebacks",
    "offered_rps",
    "gpu_utilization",
    "busy_balance",
    "cpu_ms_per_request",
    "predicted_vs_reported",
    "foreseen_share",
    "share_deviation",  # runs of tenants with configured shares (per_tenant.fairness)
)


def runs_of(runs: Sequence[Run], config: str, system: str) -> dict[int, Run]:
    """seed -> the available run of `system` (a label) on `config`."""
    return {
        r["seed"]: r
        for r in runs
        if r.get("available") and r.get("config") == config and label(r) == system
    }


def per_worker_medians(mine: dict[int, Run], of: Callable[[Run], list[float | None]]) -> list[Any]:
    """Per worker, the median over the seeds of a per-worker share."""
    columns: dict[int, list[float]] = {}
    for run in mine.values():
        for i, value in enumerate(of(run)):
            if finite(value):
                columns.setdefault(i, []).append(value)
    return [statistics.median(columns[i]) if i in columns else None for i in sorted(columns)]


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per config and system: medians and spreads of the figures over the seeds."""
    out = []
    for config in configs(runs):
        labels = list(dict.fromkeys(label(r) for r in runs if r.get("config") == config))
        for system in labels:
            mine = runs_of(runs, config, system)
            if not mine:
                continue
            first = mine[min(mine)]
            figures = {s: {**r, **derived(r)} for s, r in mine.items()}
            entry: dict[str, Any] = {
                "config": config,
                "system": system,
                "router": first["router"],
                "pd_caching": first.get("pd_caching"),
                "cluster": first["cluster"],
                "seeds": sorted(mine),
                "worker_roles": first.get("worker_roles"),
                "errors": sum(  # warm-ups' too: a failure like any other
                    (r.get("errors") or 0) + (r.get("warmup_errors") or 0) for r in mine.values()
                ),
                "retries_429": sum(r.get("retries_429") or 0 for r in mine.values()),
                "engine_aborts": sum(r.get("engine_aborts") or 0 for r in mine.values()),
                "retracted": sum(r.get("retracted") or 0 for r in mine.values()),
                "request_shares": per_worker_medians(mine, request_shares),
                "busy_shares": per_worker_medians(mine, busy_shares),
            }
            for key in FIGURES:
                values = [f[key] for f in figures.values() if finite(f.get(key))]
                entry[key] = spread(values)
            out.append(entry)
    return out


def find_entry(summary: Sequence[dict[str, Any]], config: str, system: str) -> dict[str, Any]:
    for e in summary:
        if e["config"] == config and e["system"] == system:
            return e
    return {}


def med(entry: dict[str, Any], key: str) -> float | None:
    figure = entry.get(key) or {}
    return figure.get("median") if isinstance(figure, dict) else None


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """`mine`'s `figure` against `other`'s in the same seed (or its own floor, `FLOOR`, or
    alone when `other` is None), `op` `limit`, at the median over the seeds."""

    name: str
    about: str
    mine: str  # a system label
    figure: str  # ttft_mean_s, ttft_p99_s, reuse_ratio, busy_balance, ...
    op: str
    limit: float
    other: str | None = None

    def value(self, run: Run, other: Run | None) -> float | None:
        mine = {**run, **derived(run)}
        if self.other is None:
            value = mine.get(self.figure)
            return value if finite(value) else None
        if self.other == FLOOR:
            return ratio(run.get(self.figure), run.get(f"floor_{self.figure}"))
        return None if other is None else ratio(run.get(self.figure), other.get(self.figure))


TargetsFor = Callable[[str, Sequence[Run]], list[Target]]  # config, its runs -> targets


@dataclass(frozen=True)
class Extra:
    """What a preset adds to its paired report: Markdown lines ahead of the targets, its
    figures for results.json (under `key`) and the plots it wrote (shown first)."""

    key: str
    lines: list[str]
    figures: dict[str, Any]
    plots: list[str]


# out_dir, the figures (runs, summary, targets, calibration, setup) -> the preset's own part
ExtraFor = Callable[[Path, dict[str, Any]], Extra]


def evaluate(
    runs: Sequence[Run], summary: Sequence[dict[str, Any]], targets_for: TargetsFor
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in configs(runs):
        mine_runs = [r for r in runs if r.get("config") == config]
        for target in targets_for(config, mine_runs):
            mine = runs_of(runs, config, target.mine)
            if not mine:
                continue
            theirs = (
                runs_of(runs, config, target.other) if target.other not in (None, FLOOR) else {}
            )
            per_seed = {s: target.value(r, theirs.get(s)) for s, r in mine.items()}
            kept = {s: v for s, v in per_seed.items() if finite(v)}
            figure = spread(list(kept.values())) or {}
            about = f"{config}: {target.mine} {target.about}"
            t = check(figure.get("median"), target.op, target.limit, about)
            t["spread"] = [figure.get("min"), figure.get("max")]
            t["per_seed"] = kept
            ours = find_entry(summary, config, target.mine)
            other = find_entry(summary, config, target.other or "")
            t["detail"] = detail(target, ours, other)
            if t["met"] is not True:
                t["why"] = why(target, ours, other, mine, theirs)
            key = slug(f"{config}_{target.mine}_{target.name}")
            out[key] = with_errors(t, [*mine.values(), *theirs.values()])
    return out


def slug(text: str) -> str:
    kept = "".join(c if c.isalnum() else "_" for c in text.lower())
    return "_".join(p for p in kept.split("_") if p)


def share_text(values: Sequence[Any] | None, roles: Sequence[str] | None = None) -> str:
    """Shares per worker, grouped by role on a PD cluster: `P 60%/40%, D 50%/50%`."""
    values = list(values or [])
    if not values:
        return "?"
    roles = list(roles or [])
    if len(roles) != len(values) or set(roles) <= {"colocated"}:
        return "/".join(pct(v) for v in values)
    groups: dict[str, list[str]] = {}
    for role, value in zip(roles, values, strict=True):
        groups.setdefault(role[:1].upper(), []).append(pct(value))
    return ", ".join(f"{r} {'/'.join(v)}" for r, v in groups.items())


def detail(target: Target, ours: dict[str, Any], other: dict[str, Any]) -> str:
    roles = ours.get("worker_roles")
    if target.figure == "busy_balance":
        return (
            f"busy share per worker {share_text(ours.get('busy_shares'), roles)}, requests "
            f"{share_text(ours.get('request_shares'), roles)} (medians)"
        )
    if target.figure == "reuse_ratio":
        return f"hit {pct(med(ours, 'reuse_ratio'))} vs {pct(med(other, 'reuse_ratio'))} (medians)"
    if target.figure == "share_deviation":
        worst = med(ours, "share_deviation")
        shown = "?" if worst is None else f"{worst:.2f}"
        return f"largest |goodput share / configured share - 1| of a tenant {shown} (median)"
    if target.figure == "hit_vs_oracle":
        hit, oracle = med(ours, "reuse_ratio"), med(ours, "oracle_hit_ratio")
        return f"hit {pct(hit)} vs the oracle's {pct(oracle)} (medians)"
    base = f"{target.figure.removesuffix('_s').replace('_', ' ')} {secs(med(ours, target.figure))}"
    if target.other == FLOOR:
        return f"{base}, floor {secs(med(ours, 'floor_' + target.figure))} (medians)"
    return f"{base} vs {secs(med(other, target.figure))} (medians)"


def why(
    target: Target,
    ours: dict[str, Any],
    other: dict[str, Any],
    mine: dict[int, Run],
    theirs: dict[int, Run],
) -> str:
    """The figures that explain a miss, from the runs themselves."""
    if not mine:
        return "no run"
    if target.other not in (None, FLOOR) and not theirs:
        return f"{target.other} did not run"
    seed = min(mine)
    run = mine[seed]
    parts = [
        f"ours: TTFT mean {secs(med(ours, 'ttft_mean_s'))}, p99 {secs(med(ours, 'ttft_p99_s'))}"
        f", floor p99 {secs(med(ours, 'floor_ttft_p99_s'))}, hit {pct(med(ours, 'reuse_ratio'))}"
    ]
    if other:
        parts.append(
            f"{other['system']}: TTFT mean {secs(med(other, 'ttft_mean_s'))}, p99 "
            f"{secs(med(other, 'ttft_p99_s'))}, hit {pct(med(other, 'reuse_ratio'))}"
        )
    roles = run.get("worker_roles")
    parts.append(
        f"ours per worker (seed {seed}): requests {share_text(request_shares(run), roles)}, "
        f"busy {share_text(busy_shares(run), roles)}"
    )
    if other and seed in theirs:
        them = theirs[seed]
        parts.append(
            f"{other['system']}'s: requests {share_text(request_shares(them), roles)}, busy "
            f"{share_text(busy_shares(them), roles)}"
        )
    if target.figure == "ttft_p99_s" and finite(med(ours, "queue_floor_ttft_p99_s")):
        parts.append(
            f"an ideal router's queue (the queued floor) p99 "
            f"{secs(med(ours, 'queue_floor_ttft_p99_s'))} = "
            f"{spread_text(ours.get('queue_floor_vs_floor'))} x the floor"
        )
        if finite(med(ours, "lru_queue_floor_ttft_p99_s")):
            parts.append(
                f"with the cluster's LRU caches instead of the oracle's (the LRU reference: "
                f"hit {pct(med(ours, 'lru_hit_ratio'))}), that queue's p99 is "
                f"{secs(med(ours, 'lru_queue_floor_ttft_p99_s'))}"
            )
        parts.append(reachable(target, mine, theirs))
    if target.figure.startswith("ttft"):
        parts.append(f"ours' slowest 5%: {tail_summary(run, turns=False)}")
        if seed in theirs:
            parts.append(f"theirs: {tail_summary(theirs[seed], turns=False)}")
    if run.get("router_decisions"):
        parts.append(f"ours' decisions: {reasons(run)}")
    if run.get("worker_time_scales"):  # a mixed cluster: which worker is how slow
        scales = "/".join(f"{s:g}" for s in run["worker_time_scales"])
        parts.append(f"workers' time scales {scales}")
    parts.append(f"GPU busy {pct(run.get('gpu_utilization'))}")
    cpu = med(ours, "cpu_ms_per_request")
    if finite(cpu):  # the client, routers and workers share the machine's cores
        theirs_cpu = med(other, "cpu_ms_per_request") if other else None
        text = f"CPU ms/request (client, router with its start-up, workers) {cpu:.0f}"
        if finite(theirs_cpu):
            text += f" vs {theirs_cpu:.0f}"
        if finite(run.get("loadavg_1m")):
            text += f", machine load {run['loadavg_1m']:.1f} on {os.cpu_count()} cores"
        parts.append(text)
    return "; ".join(parts)


def reachable(target: Target, mine: dict[int, Run], theirs: dict[int, Run]) -> str:
    """Per seed, whether a p99 at the target's limit is possible at all: under the floor's
    p99 no system gets (every request's TTFT is at least its floor), under the queued
    floor's no router gets on FIFO engines at that load."""
    below_floor, below_queue, below_lru, lru_seeds, seeds = 0, 0, 0, 0, 0
    for seed, run in mine.items():
        base = run.get("floor_ttft_p99_s") if target.other == FLOOR else None
        if target.other not in (None, FLOOR) and seed in theirs:
            base = theirs[seed].get(target.figure)
        floor, queued = run.get("floor_ttft_p99_s"), run.get("queue_floor_ttft_p99_s")
        if not (finite(base) and finite(floor) and finite(queued)):
            continue
        seeds += 1
        allowed = target.limit * base
        below_floor += allowed < floor
        below_queue += allowed < queued
        lru = run.get("lru_queue_floor_ttft_p99_s")
        if finite(lru):
            lru_seeds += 1
            below_lru += allowed < lru
    text = (
        f"the limit's p99 is below the floor's on {below_floor} of {seeds} seeds and below "
        f"the queued floor's on {below_queue} of {seeds}"
    )
    if lru_seeds:
        text += f" (the LRU reference's queued floor's on {below_lru} of {lru_seeds})"
    return text


# --------------------------------------------------------------------------- Markdown


def gib(entry: dict[str, Any], key: str) -> Any:
    value = med(entry, key)
    return rounded(value / 2**30, 2) if finite(value) else None


def rows_of(
    summary: Sequence[dict[str, Any]], config: str, row: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """One table row per system of `config`."""
    return [{"system": e["system"], **row(e)} for e in summary if e["config"] == config]


def latency_row(e: dict[str, Any]) -> dict[str, Any]:
    seen = med(e, "foreseen_share")
    return {
        "TTFT mean": spread_text(e.get("ttft_mean_s"), 3),
        "p50": rounded(med(e, "ttft_p50_s")),
        "p99": spread_text(e.get("ttft_p99_s"), 3),
        "floor p99": rounded(med(e, "floor_ttft_p99_s")),
        "p99/floor": spread_text(e.get("p99_vs_floor")),
        "queued floor p99": spread_text(e.get("queue_floor_ttft_p99_s"), 3),
        "LRU queued p99": spread_text(e.get("lru_queue_floor_ttft_p99_s"), 3),
        "JCT mean": rounded(med(e, "jct_mean_s")),
        "JCT p99": rounded(med(e, "jct_p99_s")),
        "hit": pct(med(e, "reuse_ratio")),
        "oracle": pct(med(e, "oracle_hit_ratio")),
        "LRU ref": pct(med(e, "lru_hit_ratio")),
        "device": pct(med(e, "device_share")),
        "host": pct(med(e, "host_share")),
        "pulled": pct(med(e, "pulled_share")),
        "written back": written_back_text(e),
        "recomputed": pct(med(e, "recomputed_share")),
        # ours: what its trees foresaw of what the workers reported (peers count neither)
        "predicted/reported": ratio_text(med(e, "predicted_vs_reported")),
        "foreseen": pct(seen) if finite(seen) else None,
    }


def written_back_text(e: dict[str, Any]) -> str:
    """The written-back share, or n/a where no run of the entry had workers reporting it."""
    share = med(e, "written_back_share")
    if not finite(share):
        return "n/a"
    return f"{share:.1%}" if share < 0.1 else pct(share)  # (short answers: a small share)


def movement_row(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "KV P->D GiB": gib(e, "kv_pd_bytes"),
        "KV write-back GiB": gib(e, "kv_writeback_bytes"),
        "write-backs": rounded(med(e, "writebacks"), 0),
        "KV pulled GiB": gib(e, "kv_pulled_bytes"),
        "requests per worker": share_text(e.get("request_shares"), e.get("worker_roles")),
        "busy per worker": share_text(e.get("busy_shares"), e.get("worker_roles")),
        "least busy / mean": spread_text(e.get("busy_balance")),
        "sent/s": rounded(med(e, "offered_rps"), 2),
        "GPU busy": pct(med(e, "gpu_utilization")),
        "CPU ms/req": rounded(med(e, "cpu_ms_per_request"), 0),
        "errors": e.get("errors"),
        "429 retries": e.get("retries_429"),
        "aborted": e.get("engine_aborts"),
        "retracted": e.get("retracted"),
    }


def calibration_rows(calibration: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, c in calibration.items():
        steps = c.get("steps") or []
        path = ", ".join(
            f"{s['offered_rps']:.2f}->{s['completed_rps']:.2f}"
            for s in steps
            if finite(s.get("offered_rps")) and finite(s.get("completed_rps"))
        )
        sustained = c.get("sustained_rps")
        rows.append(
            {
                "config": key,
                "reference": c.get("reference"),
                "floor bound req/s": rounded(c.get("floor_bound_rps"), 2),
                "offered->completed req/s": path or c.get("stopped"),
                "sustained req/s": rounded(sustained, 2),
                "runs offered at": f"{c.get('load', 0):.0%} = {c.get('load', 0) * sustained:.2f}"
                if finite(sustained)
                else None,
                "stopped": c.get("stopped"),
            }
        )
    return rows


def sections(
    runs: Sequence[Run],
    summary: Sequence[dict[str, Any]],
    targets: dict[str, Any],
    calibration: dict[str, Any],
    setup: dict[str, Any],
) -> list[str]:
    seeds = sorted({r["seed"] for r in runs if r.get("seed") is not None})
    out = table_section(
        f"Targets (reported, not asserted; medians over {len(seeds)} paired seed"
        f"{'s' if len(seeds) != 1 else ''}: {', '.join(map(str, seeds))})",
        target_rows(targets),
    )
    if calibration:
        out += table_section(
            "Sustained rate (measured on each cluster before its runs)",
            calibration_rows(calibration),
        )
    for config in configs(runs):
        s = setup.get(config) or {}
        out += [f"## {config}", ""]
        if s.get("text"):
            out += [s["text"], ""]
        out += [
            "TTFT and JCT in seconds; median [min..max] over the seeds where they differ.",
            "",
            markdown_table(rows_of(summary, config, latency_row)),
            "",
            markdown_table(rows_of(summary, config, movement_row)),
            "",
        ]
    skipped = [r for r in runs if not r.get("available")]
    if skipped:
        out += ["### Not run", ""]
        out += [
            f"- {label(r)} on {r['cluster']} seed {r.get('seed')}: {r['reason']}" for r in skipped
        ]
        out.append("")
    return out


def notes(
    doc: str, given: Sequence[str], runs: Sequence[Run], peers: dict[str, PeerStatus]
) -> list[str]:
    """What this run was (the preset's page says what it measures and why; the reading page
    what each column means), then the facts only the run knows."""
    out = [
        f"What the preset runs and why: `docs/benchmarks/{doc}`; the columns (hit, oracle, "
        "floor, queued floor, LRU ref, written back): `docs/benchmarks/reading.md`.",
        *given,
        f"Sim workers model {sim_text(sim_model())}.",
        f"Peers: {peers_text(peers)}; default thresholds. smg runs with "
        "--disable-tokenizer-autoload.",
        f"Machine: {os.cpu_count()} cores run the client, the routers and every worker.",
    ]
    loads = [r["loadavg_1m"] for r in runs if finite(r.get("loadavg_1m"))]
    if loads:
        out.append(
            f"Machine load at the end of each run (1-minute average): {min(loads):.1f} to "
            f"{max(loads):.1f} on {os.cpu_count()} cores."
        )
    unsynced = [r for r in runs if r.get("events_synced") is False]
    if unsynced:
        out.append(
            f"{len(unsynced)} runs of ours began before every worker's clear event reached "
            "the router: " + "; ".join(f"{label(r)} seed {r['seed']}" for r in unsynced)
        )
    # each workload's parameters per seed, once for the configs that share them
    shared: dict[tuple[Any, Any, str], list[Any]] = {}
    for run in runs:
        if run.get("workload_params"):
            key = (run.get("workload"), run.get("seed"), params_text(run["workload_params"]))
            shared.setdefault(key, [])
            if run.get("config") not in shared[key]:
                shared[key].append(run.get("config"))
    for (workload, seed, text), where in shared.items():
        out.append(
            f"Workload of {where[0] if len(where) == 1 else workload} (seed {seed}): {text}."
        )
    return out


@dataclass(frozen=True)
class Kind:
    """One paired preset: its name (results.json's `preset`; the quick one's ends in
    -quick), where it writes, its title, its page in docs/benchmarks/, its targets, and its
    own part of the page."""

    name: str
    out: Path
    title: str
    doc: str
    targets_for: TargetsFor
    page: str | None = None  # the Markdown page's file name (None: results.md)
    extra: ExtraFor | None = None


def write_paired(
    out_dir: Path, kind: Kind, given: dict[str, Any], peers: dict[str, PeerStatus]
) -> None:
    """results.json and results.md (or the kind's page) from a run's figures as results.json
    holds them: a new run's, or an earlier one's reported again (runs from before capacity's
    were paired by config have their cluster as their config); the kind's `extra` adds its
    own tables, figures and plots ahead of the common ones."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [r if r.get("config") else {**r, "config": r["cluster"]} for r in given["runs"]]
    own_notes = given.get("notes") or [f"Left out: {m}" for m in given.get("missing") or []]
    calibration, setup = given.get("calibration") or {}, given.get("setup") or {}
    command, elapsed_s = given.get("command", ""), given.get("elapsed_s", 0.0)
    summary = summarize(runs)
    targets = evaluate(runs, summary, kind.targets_for)
    figures: dict[str, Any] = {
        "preset": given["preset"],
        "command": command,
        "elapsed_s": elapsed_s,
        "runs": runs,
        "calibration": calibration,
        "summary": summary,
        "targets": targets,
        "setup": setup,
        "notes": own_notes,
        "sim_model": sim_model(),
        "peers": {name: s.__dict__ for name, s in peers.items()},
    }
    own = kind.extra(out_dir, figures) if kind.extra else None
    figures["plots"] = [*(own.plots if own else []), *plot_paired(out_dir, runs, summary, label)]
    if own is not None:
        figures[own.key] = own.figures
    met = sum(1 for t in targets.values() if t.get("met") is True)
    publish(
        out_dir,
        figures,
        kind.title,
        [
            f"`{command}` ({elapsed_s / 60:.1f} min, {len(runs)} runs; {met} of "
            f"{len(targets)} targets met).",
            "",
            *(own.lines if own else []),
            *sections(runs, summary, targets, calibration, setup),
        ],
        notes(kind.doc, own_notes, runs, peers),
        given.get("machine") or None,
        kind.page,
    )
