"""results.json (every run, the setup, the targets) and results.md (tables per step and
system as medians over seeds with their min..max, the targets, the calibration), plus the
plot. Everything here is computed from the runs, so `--report-only` can redo it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import finite
from benchmarks.multiturn.results import sim_text
from benchmarks.overload import plots
from benchmarks.overload.preset import CACHE_AWARE, WITH_DEADLINE, WITHOUT_DEADLINE
from benchmarks.overload.targets import Workers, all_targets, by_step, paired_ratios
from benchmarks.report.page import publish
from benchmarks.report.seeds import Run, median_of, ratio, spread, spread_text
from benchmarks.report.table import markdown_table, percent, rounded, table_section
from benchmarks.report.targets import target_rows

TITLE = "Overload ramp: goodput and TTFT of admitted requests, {} to {} of the sustained rate"


def values(seeds: dict[int, Run], key: str) -> list[float]:
    return [r[key] for r in seeds.values() if finite(r.get(key))]


def med(seeds: dict[int, Run], key: str, digits: int = 2) -> float | None:
    return rounded(median_of(values(seeds, key)), digits)


def with_spread(seeds: dict[int, Run], key: str) -> str | None:
    """`median (min..max)` over the seeds, or the value they agree on."""
    return spread_text(spread(values(seeds, key)), parens=True)


def system_order(runs: Sequence[Run]) -> list[str]:
    known = [WITH_DEADLINE, WITHOUT_DEADLINE, CACHE_AWARE]
    seen = list(dict.fromkeys(r["system"] for r in runs))
    return [s for s in known if s in seen] + [s for s in seen if s not in known]


def step_rows(runs: Sequence[Run], deadline_s: float) -> list[dict[str, Any]]:
    """One row per step and system: medians over seeds (goodput and p99 with min..max);
    the longest wait is the longest over every seed."""
    rows = []
    per_system = {s: by_step(runs, s) for s in system_order(runs)}
    fractions = sorted({f for steps in per_system.values() for f in steps})
    for fraction in fractions:
        for system, steps in per_system.items():
            seeds = steps.get(fraction)
            if not seeds:
                continue
            waits = values(seeds, "wait_max_s")
            rows.append(
                {
                    "load": f"{fraction:.0%}",
                    "offered req/s": med(seeds, "rate"),
                    "sent req/s": med(seeds, "sent_rps"),
                    "system": system,
                    "admitted": med(seeds, "admitted", 0),
                    "refused (429)": med(seeds, "refused", 0),
                    "errors": med(seeds, "errors", 0),
                    "goodput req/s": with_spread(seeds, "goodput_rps"),
                    "throughput req/s": med(seeds, "throughput_rps"),
                    "within SLO": percent(median_of(values(seeds, "slo_share"))),
                    "TTFT p50": med(seeds, "ttft_p50_s"),
                    "TTFT p99": with_spread(seeds, "ttft_p99_s"),
                    "longest wait": round(max(waits), 2) if waits else None,
                    "/ D": round(max(waits) / deadline_s, 2) if waits else None,
                    "waits > D": int(sum(values(seeds, "over_deadline"))),
                    "retracted": int(sum(values(seeds, "retracted"))),
                    "hit": percent(median_of(values(seeds, "hit_ratio"))),
                }
            )
    return rows


def ratio_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per step: each of ours' goodput over cache_aware's, paired per seed."""
    ours = [s for s in (WITH_DEADLINE, WITHOUT_DEADLINE) if s in system_order(runs)]
    ratios = {s: paired_ratios(runs, s) for s in ours}
    fractions = sorted({f for r in ratios.values() for f in r})
    rows = []
    for fraction in fractions:
        row: dict[str, Any] = {"load": f"{fraction:.0%}"}
        for system in ours:
            row[f"{system} / cache_aware"] = spread_text(ratios[system].get(fraction), parens=True)
        rows.append(row)
    return rows


def run_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every run, for the record."""
    return [
        {
            "load": f"{r['fraction']:.0%}",
            "seed": r["seed"],
            "system": r["system"],
            "req": r["requests"],
            "admitted": r["admitted"],
            "refused": r["refused"],
            "err": r["errors"],
            "good": r["good"],
            "goodput": round(r["goodput_rps"], 2),
            "thr": round(r["throughput_rps"], 2),
            "p50": rounded(r.get("ttft_p50_s"), 2),
            "p99": rounded(r.get("ttft_p99_s"), 2),
            "wait p99": rounded(r.get("wait_p99_s"), 2),
            "wait max": rounded(r.get("wait_max_s"), 2),
            "retracted": r.get("retracted"),
            # ours: the cached tokens its trees predicted over those the workers reported
            "predicted/reported": rounded(
                ratio(r.get("router_predicted_cached"), r.get("router_reported_cached")), 2
            ),
            "load avg": rounded(r.get("loadavg_1m"), 1),
        }
        for r in runs
    ]


def definitions(setup: dict[str, Any]) -> list[str]:
    d, k, floor = setup["deadline_s"], setup["deadline_multiple"], setup["mean_floor_s"]
    return [
        "## How the figures are made",
        "",
        f"- **Deadline D = {d:.2f} s**: {k:g} x the request pool's mean floor TTFT "
        f"({floor:.3f} s; a request's floor is its TTFT alone on an instance holding every "
        "earlier prompt, the oracle's cache, in the sim's latency model at this time scale). "
        "Ours with the deadline runs `--max-expected-wait-secs D`.",
        "- **TTFT SLO** of a request: its floor + D. **Goodput**: answered requests within "
        "their SLO per second of the run's span (first send to last answer); **throughput**: "
        "every answered request per second of the same span.",
        "- **Wait** of an admitted, answered request: its TTFT minus its own prefill alone "
        "with the prefix its worker reported cached (the answer's `cached_tokens`), in the "
        "same latency model: the router's queue, the worker's queue, and the steps its "
        "prefill shared with other requests' prefills and decodes. `longest wait` is the "
        "longest over every seed of the step; `waits > D` counts them over the seeds.",
        f"- **Sustained rate {setup['sustained_rps']:.2f} req/s**: measured before the ramp on "
        f"seed {setup['calibration_seed']}'s requests (table below): runs of "
        f"{setup['calibration_duration_s']:g} s of `{WITHOUT_DEADLINE}` at rising rates; a "
        "rate holds while the median request meets its SLO and its completed prefills per "
        "second (first tokens between a quarter of the send window and the last send: the "
        "settled rate, free of the start and the drain; answers end long after their first "
        "token here, so they would lag the load) grew by at least half as much as the "
        "offered rate; the sustained rate is the highest that held.",
        f"- Each step offers rate x {setup['step_duration_s']:g} s requests, open loop "
        "(Poisson arrivals), the same requests at the same times to every system; no "
        "retries: a 429 is `refused (429)`; `errors` are other failures. Medians over "
        f"seeds {', '.join(str(s) for s in setup['seeds'])}; `(min..max)` their spread.",
        "",
    ]


def calibration_rows(setup: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "offered req/s": round(r["rate"], 2),
            "first tokens/s": round(r["first_tokens_rps"], 2),
            "within SLO": percent(r["slo_share"]),
            "held": r["held"],
            "why not": r["why"],
        }
        for r in setup["calibration"]
    ]


def notes(setup: dict[str, Any], runs: Sequence[Run], peers: dict[str, Any]) -> list[str]:
    model = setup["sim_model"]
    workload = ", ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in setup["workload"].items()
    )
    peer_text = "; ".join(
        f"{name} {s.get('version')}" if s.get("importable") else f"{name}: {s.get('reason')}"
        for name, s in peers.items()
    )
    loads = [r["loadavg_1m"] for r in runs if finite(r.get("loadavg_1m"))]
    out = [
        f"Preset: {setup['preset']}. Times in seconds. TTFT: the first streamed chunk with "
        "content, at the client.",
        f"Workers: {setup['instances']} x `python -m connector.worker --backend sim "
        f"--tokenizer-cache --time-scale {setup['time_scale']:g}` (the sim models "
        f"{sim_text(model)}; `--time-scale {setup['time_scale']:g}` makes every modelled second "
        f"{setup['time_scale']:g} wall seconds, so two CPU cores can offer 150% of what the "
        f"workers sustain). KV capacity per instance: {setup['kv_capacity_tokens']:,} tokens "
        "(the modelled H100's: the ramp is about queues, not eviction); chunked prefill "
        f"{setup['chunked_prefill_size']} tokens.",
        "Our router (both of ours) runs with its cost model set to the workers as they run, "
        f"the sim's H100 terms x {setup['time_scale']:g}: `{' '.join(setup['cost_model_args'])}`"
        f"; with the deadline also `--max-expected-wait-secs {setup['deadline_s']:.3f} "
        f"--queue-size {setup['queue_size']}`"
        + (
            " (refuse at once when every worker's expected wait is past D: a request held in "
            "the router's queue would wait there on top of D)."
            if setup["queue_size"] == 0
            else "."
        ),
        f"Peers: {peer_text}; sglang-router runs `--policy cache_aware` with its defaults "
        "(no concurrency limit, so it admits everything).",
        f"Workload: {workload}.",
    ]
    if loads:
        out.append(
            f"Machine load at the end of each run (1-minute load average, {os.cpu_count()} "
            f"cores): {min(loads):.1f} to {max(loads):.1f}."
        )
    return out


def write(out_dir: Path, measured: dict[str, Any], machine: dict[str, Any] | None = None) -> None:
    """results.json, results.md and the plot from what a run `measured`: its `setup`,
    `runs`, `peers`, `elapsed_s` and `command` (a results.json's own, for --report-only)."""
    setup, runs = measured["setup"], measured["runs"]
    elapsed_s, command = measured["elapsed_s"], measured["command"]
    deadline = setup["deadline_s"]
    workers = Workers(
        setup["sim_model"]["prefill_per_token_s"] * setup["time_scale"],
        int(setup.get("chunked_prefill_size") or 0),
    )
    targets = all_targets(runs, deadline, workers)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    png = plots.plot(Path(out_dir), runs, system_order(runs), setup["sustained_rps"], deadline)
    figures = {
        **{k: measured[k] for k in ("preset", "command", "elapsed_s", "setup", "peers", "runs")},
        "targets": targets,
        "goodput_vs_cache_aware": {
            s: {f"{f:.2f}": v for f, v in paired_ratios(runs, s).items()}
            for s in (WITH_DEADLINE, WITHOUT_DEADLINE)
        },
        "plots": [png] if png else [],
    }
    body = [
        f"`{command}` ({elapsed_s / 60:.1f} min).",
        "",
        markdown_table(step_rows(runs, deadline)),
        "",
        *table_section("Targets (reported, not asserted)", target_rows(targets)),
        *table_section(
            "Goodput against sglang-router cache_aware (paired per seed)", ratio_rows(runs)
        ),
        *definitions(setup),
        *table_section("Calibration of the sustained rate", calibration_rows(setup)),
        *table_section("Every run", run_rows(runs)),
    ]
    fractions = setup["fractions"]
    title = TITLE.format(f"{min(fractions):.0%}", f"{max(fractions):.0%}")
    publish(Path(out_dir), figures, title, body, notes(setup, runs, measured["peers"]), machine)
