"""`--tenants`: tenants sharing a public tool prompt with private documents after it, on 4
sim workers near what they sustain: what isolating the tenants costs, and how a saturated
router shares the cluster among them.

The workload (`tenants.TenantPrefix`): 4 tenants, each request the tool prompt every tenant
sends, then one of its tenant's own documents and a new question, sent with the tenant's
API key. Each worker's device KV is half the hot set (as in `--hot-prefix` and `--lora`);
the rate is 85 % of what sglang-router's round_robin sustains on the same workers.

Systems, on the same workers and requests: ours without tenants (no isolation: one
namespace for all), ours with `--tenants` and no public prefix (full isolation: every
tenant's whole prompt salted, so the tool prompt is cached once per tenant), ours with
`--tenants` and the tool prompt declared public (cached once for all, the tenant's text
after it salted), and sglang-router cache_aware (no isolation), the peer.

The fairness cell: the same tenants at 3x the sustained rate, tenant t3 sending 40 % of the
requests (6x its share), our router with configured shares 2:1:1:1 (the tenants file's
`share`) and `--max-concurrent-requests` so that requests queue in the router; each
tenant's share of the goodput (computed prompt tokens of the requests completed while the
load lasted, `per_tenant`) against its configured share.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.capacity import Features
from benchmarks.multiturn.cluster import CACHE_AWARE, ROUND_ROBIN, RouterSpec
from benchmarks.multiturn.paired import Config, HotSetKV, Member, PairedPlan, selected
from benchmarks.multiturn.paired_report import Extra, Run, Target, runs_of
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.targets import pct
from benchmarks.multiturn.tenants import TenantPrefix, tenant_key, tool_prompt
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.versus import over_seeds, per_seed_text, system_rows, warm_text
from benchmarks.multiturn.workloads import OPENAI
from benchmarks.peers import OURS
from benchmarks.report.seeds import configs
from benchmarks.report.table import table_section
from router.tenants.config import hash_key

TENANTS = "tenants"
TENANTS_QUICK = "tenants-quick"
INSTANCES = 4
LOAD = 0.85
KV_SHARE = 0.5  # a worker's device KV, as a share of the hot set
CALIBRATION_SEED = 101
SHAPE = "4 colocated"
TARGET_MEAN = 1.1  # issue 38: public-prefix isolation's mean TTFT at most 1.1x no isolation's
SAFEKV_COST = 0.389  # SafeKV (arXiv 2508.08438): full isolation costs up to 38.9 % TTFT
SHARES = (2.0, 1.0, 1.0, 1.0)  # the fairness cell's configured shares, t0..t3
FAIR_WEIGHTS = (0.3, 0.15, 0.15, 0.4)  # what each tenant sends: t3 6x its share, t0-t2 2.25x
FAIR_LOAD = 3.0  # x the sustained rate: every tenant offers more than its share
FAIR_TARGET = 0.10  # issue 38: each tenant's goodput share within 10 % of its configured one
MAX_CONCURRENT = 8  # the fairness cell's --max-concurrent-requests: 2 a worker
FAIRNESS = "fairness"
# the routers' operator key (--api-key): the benchmark's probes and scrapes of a router with
# tenants send it, its clients their tenants' keys
OPERATOR_KEY = "bench-operator-key"

NO_ISOLATION = RouterSpec(OURS, "prompt_tree")
FULL_TAG = "tenants"
PUBLIC_TAG = "tenants public"
FAIR_TAG = "tenants shares"
FULL_ISOLATION = f"{NO_ISOLATION.name} {FULL_TAG}"
PUBLIC_ISOLATION = f"{NO_ISOLATION.name} {PUBLIC_TAG}"
FAIR_SYSTEM = f"{NO_ISOLATION.name} {FAIR_TAG}"
SYSTEM_NAMES = (NO_ISOLATION.name, FULL_ISOLATION, PUBLIC_ISOLATION, CACHE_AWARE.name)


@dataclass(frozen=True)
class TenantsPreset:
    name: str
    workload: TenantPrefix  # at a nominal rate; the seed and rate are set per run
    calibration: TenantPrefix
    seeds: tuple[int, ...]
    systems: tuple[str, ...]  # of SYSTEM_NAMES
    time_scale: float
    search: Search = field(default_factory=Search)
    load: float = LOAD
    fairness: bool = True
    # the fairness cell's requests (0: the workload's): enough that the window while they
    # are sent holds several hundred answers, and each tenant's share is not decided by a
    # few cold prompts nor by the requests in flight when the window ends (600 gave 5-31
    # answers per small tenant in the window, and shares off by 0.14-0.56)
    fair_requests: int = 0


def full_preset() -> TenantsPreset:
    """About 20 min on 2 cores: a calibration of at most 5 steps of 120 requests, then 12
    runs (4 systems x 3 seeds) of 240 requests of 4-5.7K-token prompts and 3 fairness runs
    of 2,400 (about 4.5 min each)."""
    workload = TenantPrefix()
    return TenantsPreset(
        TENANTS,
        workload,
        replace(workload, seed=CALIBRATION_SEED, requests=120),
        seeds=(1, 2, 3),
        systems=SYSTEM_NAMES,
        time_scale=4.0,
        search=Search(max_steps=5),
        fair_requests=2400,
    )


def quick_preset() -> TenantsPreset:
    """About a minute: short prompts, the four systems, one seed, a two-step calibration and
    the fairness cell."""
    workload = TenantPrefix(
        tool_tokens=1200,
        documents=2,
        document_min_tokens=300,
        document_max_tokens=600,
        question_max_tokens=60,
        answer_tokens=8,
        requests=24,
    )
    return TenantsPreset(
        TENANTS_QUICK,
        workload,
        replace(workload, seed=CALIBRATION_SEED, requests=20),
        seeds=(1,),
        systems=SYSTEM_NAMES,
        time_scale=4.0,
        search=Search(max_steps=2, factor=1.6),
        # 24 at 3x the sustained rate were all sent (0.7 s) before the first answer came, so
        # no goodput fell in the window; 72 take about 2 s to send
        fair_requests=72,
    )


def tenants_file(
    builder: TenantPrefix, vocab: Vocab, public: bool, shares: Sequence[float] = ()
) -> str:
    """The router's tenants file (inline JSON) for the workload's tenants: each tenant's key
    hashed, the tool prompt public when `public`, each tenant's `share` when given."""
    entries = []
    for k, name in enumerate(builder.tenant_names):
        entry: dict[str, Any] = {"id": name, "keys": [hash_key(tenant_key(name))]}
        if shares:
            entry["share"] = shares[k]
        entries.append(entry)
    data: dict[str, Any] = {"tenants": entries}
    if public:
        data["public_prefixes"] = [{"text": tool_prompt(vocab, builder.tool_tokens)[0]}]
    return json.dumps(data)


def systems_of(builder: TenantPrefix, vocab: Vocab) -> dict[str, RouterSpec]:
    """The compared systems by name (their tenants files made for this workload)."""
    full = ("--tenants", tenants_file(builder, vocab, public=False))
    public = ("--tenants", tenants_file(builder, vocab, public=True))
    specs = (
        NO_ISOLATION,
        replace(NO_ISOLATION, args=full, tag=FULL_TAG, api_key=OPERATOR_KEY),
        replace(NO_ISOLATION, args=public, tag=PUBLIC_TAG, api_key=OPERATOR_KEY),
        CACHE_AWARE,
    )
    return {s.name: s for s in specs}


def fair_system(builder: TenantPrefix, vocab: Vocab) -> RouterSpec:
    """Ours with tenants (tool prompt public), their shares, and at most MAX_CONCURRENT
    requests inside it: the rest wait in its queue (long enough for the whole run, so none
    is refused)."""
    tenants = tenants_file(builder, vocab, public=True, shares=SHARES)
    args = (
        *("--tenants", tenants, "--max-concurrent-requests", str(MAX_CONCURRENT)),
        *("--queue-size", "100000", "--queue-timeout-secs", "3600"),
    )
    return replace(NO_ISOLATION, args=args, tag=FAIR_TAG, api_key=OPERATOR_KEY)


def make_plan(
    preset: TenantsPreset,
    vocab: Vocab,
    features: Features,
    systems: set[str] | None = None,
    on_seed: Callable[[], None] = lambda: None,
    known: dict[str, dict[str, Any]] | None = None,
) -> PairedPlan:
    """Every seed's workload built, the KV sized from their hot sets (or as `known` sized
    it); the isolation config and the fairness config (which shares its sustained rate).
    ValueError when nothing is left to run."""
    builders = {seed: replace(preset.workload, seed=seed) for seed in preset.seeds}
    sized = HotSetKV.of_builders(builders, vocab, known, KV_SHARE, INSTANCES, on_seed)
    name, hot_set, kv = sized.name, sized.hot_set, sized.kv
    by_name = systems_of(preset.workload, vocab)
    specs = tuple(by_name[s] for s in preset.systems if selected(systems, s, None) and s in by_name)
    fair = fair_system(preset.workload, vocab)
    run_fair = preset.fairness and selected(systems, fair.name, None)
    if not specs and not run_fair:
        raise ValueError("nothing to run: no system of the preset has those names")
    tenants = preset.workload.tenants
    cluster = sized.cluster("tn-c4", SHAPE, preset.time_scale, features, colocated=INSTANCES)
    key = f"{name}, {SHAPE}, {tenants} tenants"
    labels = {"shape": SHAPE, "instance_kv_tokens": kv, "hot_set_tokens": hot_set}
    planned = []
    if specs:
        planned.append(
            Config(
                key,
                name,
                builders,
                preset.calibration,
                (Member(cluster, specs),),
                ROUND_ROBIN,
                preset.load,
                OPENAI,
                labels,
            )
        )
    fair_key = f"{name} {FAIRNESS}, {SHAPE}, {tenants} tenants"
    if run_fair:
        shares = dict(zip(preset.workload.tenant_names, SHARES, strict=True))
        planned.append(
            Config(
                fair_key,
                name,
                {
                    s: replace(b, weights=FAIR_WEIGHTS, requests=preset.fair_requests or b.requests)
                    for s, b in builders.items()
                },
                preset.calibration,
                (Member(replace(cluster, name="tn-fair-c4"), (fair,)),),
                ROUND_ROBIN,
                FAIR_LOAD,
                OPENAI,
                {**labels, "tenant_shares": shares},
                rate_key=key,
            )
        )
    text = (
        f"{SHAPE} sim workers, time scale {preset.time_scale:g}, {tenants} tenants; "
        f"{sized.kv_text(KV_SHARE)}"
    )
    common = {
        **sized.setup(preset.time_scale),
        "tenants": tenants,
    }
    setup = {
        key: {**common, "text": f"{text}; offered at {preset.load:.0%} of the sustained rate."},
        fair_key: {
            **common,
            "shares": list(SHARES),
            "sent_weights": list(FAIR_WEIGHTS),
            "max_concurrent_requests": MAX_CONCURRENT,
            "text": (
                f"{text}; offered at {FAIR_LOAD:g}x the sustained rate of the config above, "
                f"tenants sending {' / '.join(f'{w:.0%}' for w in FAIR_WEIGHTS)} of the "
                f"requests, configured shares {':'.join(f'{s:g}' for s in SHARES)}, "
                f"--max-concurrent-requests {MAX_CONCURRENT}."
            ),
        },
    }
    setup = {k: v for k, v in setup.items() if any(c.key == k for c in planned)}
    return PairedPlan(preset.name, planned, preset.search, features.missing(), setup)


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """Issue 38's: public-prefix isolation's mean TTFT at most 1.1x no isolation's; in the
    fairness cell, every tenant's goodput share within 10 % of its configured share."""
    if f" {FAIRNESS}, " in config:
        return [
            Target(
                "goodput_shares",
                "largest |goodput share / configured share - 1| of a tenant",
                FAIR_SYSTEM,
                "share_deviation",
                "<=",
                FAIR_TARGET,
            )
        ]
    return [
        Target(
            "mean_vs_no_isolation",
            f"mean TTFT / {NO_ISOLATION.name}'s (no isolation)",
            PUBLIC_ISOLATION,
            "ttft_mean_s",
            "<=",
            TARGET_MEAN,
            NO_ISOLATION.name,
        )
    ]


# --------------------------------------------------------------------------- the report


def isolation_rows(runs: Sequence[Run], config: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per system: TTFT, hit and their ratios to no isolation's within each seed."""
    return system_rows(runs, config, NO_ISOLATION.name, "no isolation")


def tenant_value(run: Run, key: str, tenant: str) -> Any:
    """The tenant's entry of the run's `key` mapping (`sent_shares`: its workload's)."""
    where = (run.get("workload_params") or {}) if key == "sent_shares" else run
    return (where.get(key) or {}).get(tenant)


def fairness_rows(runs: Sequence[Run], config: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per tenant: its configured share, what it sent, its goodput shares (median over the
    seeds) and the goodput token share over the configured one."""
    mine = runs_of(runs, config, FAIR_SYSTEM)
    if not mine:
        return [], []
    rows, figures = [], []
    tenants = list(next(iter(mine.values())).get("configured_shares") or {})
    for tenant in tenants:
        configured, tokens, done, sent, fair = (
            over_seeds(mine, functools.partial(tenant_value, key=key, tenant=tenant))
            for key in (
                "configured_shares",
                "goodput_token_shares",
                "goodput_request_shares",
                "sent_shares",
                "max_min_shares",
            )
        )
        vs = {s: tokens[s] / configured[s] for s in tokens if configured.get(s)}
        vs_fair = {s: tokens[s] / fair[s] for s in tokens if fair.get(s)}
        figures.append(
            {
                "tenant": tenant,
                "configured": configured,
                "sent": sent,
                "tokens": tokens,
                "requests": done,
                "tokens_vs_configured": vs,
                "max_min": fair,
                "tokens_vs_max_min": vs_fair,
            }
        )
        rows.append(
            {
                "tenant": tenant,
                "configured share": pct(statistics.median(configured.values()))
                if configured
                else None,
                "sent": pct(statistics.median(sent.values())) if sent else None,
                "goodput (computed tokens)": pct(statistics.median(tokens.values()))
                if tokens
                else None,
                "goodput (requests)": pct(statistics.median(done.values())) if done else None,
                "tokens / configured (per seed -> median)": per_seed_text(vs),
                "max-min fair share": pct(statistics.median(fair.values())) if fair else None,
                "tokens / max-min (per seed -> median)": per_seed_text(vs_fair),
            }
        )
    return rows, figures


def extra(out_dir: Path, figures: dict[str, Any]) -> Extra:
    """The isolation table (ratios to no isolation per seed) and the fairness table."""
    runs = figures["runs"]
    lines: list[str] = []
    tables: dict[str, Any] = {}
    for config in configs(runs):
        if f" {FAIRNESS}, " in config:
            rows, per_tenant = fairness_rows(runs, config)
            tables[config] = per_tenant
            lines += table_section(
                f"Fairness at saturation: {config}",
                rows,
                "Each tenant's share of the goodput (computed prompt tokens, and requests, "
                "prefilled while requests were still being sent and before the first tenant had "
                "all of its prompts prefilled) against its configured share (the tenants "
                "file's `share`, which the router enforces), and against its weighted max-min "
                "fair share given what it asked for (the computed tokens of its requests sent "
                "in that window: a tenant that asked for less than its configured share gets "
                "what it asked for, the others split the rest by share); medians over the "
                "seeds.",
            )
            continue
        rows, per_system = isolation_rows(runs, config)
        tables[config] = per_system
        lines += table_section(
            f"What isolation costs: {config}",
            rows,
            "Medians [min..max] over the seeds; ratios to ours without tenants (no "
            "isolation) taken within each seed (the same requests on the same workers), "
            "listed seed by seed, then their median. Published: full isolation costs up to "
            f"{SAFEKV_COST:.1%} TTFT (SafeKV, arXiv 2508.08438)." + warm_text(rows),
        )
    return Extra("tenants", lines, tables, [])
