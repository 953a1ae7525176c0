"""What a run compares: clusters, systems, workloads and request rates, per preset.

Every cluster is started once; the systems compared on it run one after another on the same
workers, caches flushed in between, in an order rotated per workload so a drift in the
machine's speed does not always favour the same system. `ours prompt_tree x2 replicas` (two
router replicas sharing state through Redis, behind a round-robin front) runs next to the
single router in both presets, and so does `ours prompt_tree x2 processes` (one router of
two processes on one port, `--processes 2`); `seeds` repeats the main workloads with other
seeds, so the two can be compared pairwise with a spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.cluster import RouterSpec
from benchmarks.multiturn.trace import DEFAULT_TRACE, TraceReplay
from benchmarks.multiturn.workloads import LooGLELike, MultiRoundQA, ReActLike, ShareGPTLike
from benchmarks.peers import OURS, SGLANG_ROUTER, SMG
from localrun.cluster import ClusterSpec

OUR_POLICIES = (
    "prompt_tree",
    "cost",
    "cache_aware",
    "session",
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
)
PEER_POLICIES = ("cache_aware", "round_robin")
TWO_REPLICAS = RouterSpec(OURS, "prompt_tree", replicas=2)
TWO_PROCESSES = RouterSpec(OURS, "prompt_tree", processes=2)

ALL_SYSTEMS = (
    *(RouterSpec(OURS, p) for p in OUR_POLICIES),
    TWO_REPLICAS,
    TWO_PROCESSES,
    *(RouterSpec(peer, p) for peer in (SGLANG_ROUTER, SMG) for p in PEER_POLICIES),
)
QUICK_SYSTEMS = (
    RouterSpec(OURS, "prompt_tree"),
    TWO_REPLICAS,
    TWO_PROCESSES,
    RouterSpec(OURS, "round_robin"),
    RouterSpec(SGLANG_ROUTER, "cache_aware"),
    RouterSpec(SGLANG_ROUTER, "round_robin"),
    RouterSpec(SMG, "cache_aware"),
)
EXTRA_SYSTEMS = (
    RouterSpec(OURS, "prompt_tree"),
    RouterSpec(OURS, "session"),
    RouterSpec(OURS, "round_robin"),
    RouterSpec(SGLANG_ROUTER, "cache_aware"),
    RouterSpec(SMG, "cache_aware"),
)
SWEEP_SYSTEMS = (
    RouterSpec(OURS, "prompt_tree"),
    RouterSpec(SGLANG_ROUTER, "cache_aware"),
    RouterSpec(SGLANG_ROUTER, "round_robin"),
    RouterSpec(SMG, "cache_aware"),
)
PROMPT_TREE = RouterSpec(OURS, "prompt_tree")
SESSION = RouterSpec(OURS, "session")
ROUND_ROBIN = RouterSpec(OURS, "round_robin")


@dataclass
class Step:
    """One workload run by several systems on one cluster."""

    cluster: str
    workload: Any  # a builder: MultiRoundQA, TraceReplay, ...
    systems: tuple[RouterSpec, ...]
    group: str  # main | rate_sweep | share_ratio | no_cache | pd | capacity
    rate: float
    labels: dict[str, Any] = field(default_factory=dict)  # copied into each run's record
    samples: bool = False  # keep every measured TTFT in the records (`ttft_samples_s`)


@dataclass
class Plan:
    preset: str
    clusters: dict[str, ClusterSpec]
    steps: list[Step]
    max_total_tokens: int | None
    notes: list[str] = field(default_factory=list)

    def runs(self) -> int:
        return sum(len(s.systems) for s in self.steps)


def rate_of(builder: Any) -> float:
    return float(getattr(builder, "qps", None) or builder.rate)


def clusters_for(trace_time_scale: float) -> dict[str, ClusterSpec]:
    ts = trace_time_scale
    trace = "" if ts == 1 else f", time scale {ts:g}"
    return {
        "4 colocated": ClusterSpec("c4", colocated=4, label="4 colocated, caching"),
        "4 colocated, no cache": ClusterSpec(
            "c4nc", colocated=4, radix_cache=False, label="4 colocated, no caching"
        ),
        f"4 colocated{trace}": ClusterSpec(
            "c4t", colocated=4, label="4 colocated, caching", time_scale=ts
        ),
        f"4 colocated, no cache{trace}": ClusterSpec(
            "c4tnc", colocated=4, radix_cache=False, label="4 colocated, no caching", time_scale=ts
        ),
        "2 colocated, no cache": ClusterSpec("c2nc", colocated=2, radix_cache=False, label="PD"),
        "2 colocated": ClusterSpec("c2", colocated=2, label="PD-CC"),
        "1P1D basic": ClusterSpec("pd-basic", prefills=1, decodes=1, caching="basic", label="1P1D"),
        "1P1D caching-1": ClusterSpec(
            "pd-c1", prefills=1, decodes=1, caching="caching-1", label="1P1D-C1"
        ),
        "1P1D caching-2": ClusterSpec(
            "pd-c2", prefills=1, decodes=1, caching="caching-2", label="1P1D-C2"
        ),
        "1P1D caching-3": ClusterSpec(
            "pd-c3", prefills=1, decodes=1, caching="caching-3", label="1P1D-CC"
        ),
    }


@dataclass(frozen=True)
class Preset:
    """Sizes of one preset; the systems each part runs."""

    trace: TraceReplay
    trace_time_scale: float
    mrqa: MultiRoundQA
    extra: dict[str, Any]  # name -> builder: ShareGPT-, LooGLE-, ReAct-like
    main_systems: tuple[RouterSpec, ...]
    extra_systems: tuple[RouterSpec, ...]
    sweep_rates: tuple[float, ...]
    sweep_systems: tuple[RouterSpec, ...]
    share: LooGLELike
    share_ratios: tuple[int, ...]
    pd_workload: Any
    pd_clusters: tuple[str, ...]
    pd_peers: tuple[RouterSpec, ...]
    no_cache: tuple[str, ...]
    max_total_tokens: int | None


def quick_preset(trace: Path) -> Preset:
    return Preset(
        trace=TraceReplay(
            trace, sessions=20, rate=8.0, max_input_tokens=16384, max_output_tokens=32
        ),
        trace_time_scale=1.0,
        mrqa=MultiRoundQA(users=6, rounds=3, history_tokens=2000, qps=6.0, requests=24),
        extra={},
        main_systems=QUICK_SYSTEMS,
        extra_systems=(),
        sweep_rates=(8.0,),
        sweep_systems=(RouterSpec(OURS, "prompt_tree"), RouterSpec(SGLANG_ROUTER, "round_robin")),
        share=LooGLELike(documents=3, questions=2, doc_tokens=3000, rate=6.0),
        share_ratios=(1, 3),
        pd_workload=ShareGPTLike(sessions=6, mean_turns=3, max_turns=4, rate=6.0),
        pd_clusters=("1P1D basic", "1P1D caching-3"),
        pd_peers=(),
        no_cache=("multi_round_qa",),
        max_total_tokens=49152,
    )


def full_preset(trace: Path) -> Preset:
    return Preset(
        # The trace runs on sim GPUs 2.5x slower than the modelled H100: the only way two
        # CPU cores can offer it at a load where the instances queue (about 80 % busy).
        trace=TraceReplay(trace, sessions=70, rate=8.0, max_output_tokens=128),
        trace_time_scale=2.5,
        mrqa=MultiRoundQA(qps=6.0, requests=240),
        extra={
            "sharegpt": ShareGPTLike(sessions=40),
            "loogle": LooGLELike(),
            "react": ReActLike(sessions=24),
        },
        main_systems=ALL_SYSTEMS,
        extra_systems=EXTRA_SYSTEMS,
        sweep_rates=(3.0, 9.0),
        sweep_systems=SWEEP_SYSTEMS,
        share=LooGLELike(rate=6.0),
        share_ratios=(1, 2, 4),
        pd_workload=ShareGPTLike(sessions=30),
        pd_clusters=(
            "2 colocated, no cache",
            "2 colocated",
            "1P1D basic",
            "1P1D caching-1",
            "1P1D caching-2",
            "1P1D caching-3",
        ),
        pd_peers=(RouterSpec(SGLANG_ROUTER, "round_robin"),),
        no_cache=("trace", "multi_round_qa"),
        max_total_tokens=None,
    )


def per_seed(builder: Any, seeds: Sequence[int]) -> list[tuple[Any, dict[str, Any]]]:
    """The builder once per seed, each labelled with its seed (as is, unlabelled, without)."""
    if not seeds:
        return [(builder, {})]
    return [(replace(builder, seed=seed), {"seed": seed}) for seed in dict.fromkeys(seeds)]


def make_plan(
    quick: bool,
    trace: Path = DEFAULT_TRACE,
    pd: bool = True,
    workloads: set[str] | None = None,
    systems: set[str] | None = None,
    seeds: Sequence[int] = (),
) -> Plan:
    """The preset's steps; `workloads` / `systems` (names) narrow it; `seeds` runs each
    main workload once per seed (the builders' own seed when empty)."""
    p = quick_preset(trace) if quick else full_preset(trace)
    ts = p.trace_time_scale
    suffix = "" if ts == 1 else f", time scale {ts:g}"
    main = {"trace": p.trace, "multi_round_qa": p.mrqa}
    main_cluster = {"trace": f"4 colocated{suffix}", "multi_round_qa": "4 colocated"}
    no_cache_cluster = {
        "trace": f"4 colocated, no cache{suffix}",
        "multi_round_qa": "4 colocated, no cache",
    }

    def wanted(name: str) -> bool:
        return workloads is None or name in workloads

    def chosen(specs: tuple[RouterSpec, ...]) -> tuple[RouterSpec, ...]:
        return tuple(s for s in specs if systems is None or s.name in systems)

    steps: list[Step] = []
    for name, builder in {**main, **p.extra}.items():
        specs = chosen(p.main_systems if name in main else p.extra_systems)
        if wanted(name) and specs:
            cluster = main_cluster.get(name, "4 colocated")
            for seeded, labels in per_seed(builder, seeds):
                steps.append(Step(cluster, seeded, specs, "main", rate_of(builder), labels))
    if wanted("multi_round_qa"):
        for rate in p.sweep_rates:
            floor = min(120, p.mrqa.requests)  # enough requests for a p99
            requests = max(floor, round(p.mrqa.requests / p.mrqa.qps * rate))
            builder = replace(p.mrqa, qps=rate, requests=requests)
            specs = chosen(p.sweep_systems)
            if specs:
                steps.append(Step("4 colocated", builder, specs, "rate_sweep", rate))
    if wanted("share_ratio"):
        for ratio in p.share_ratios:
            specs = chosen((PROMPT_TREE, SESSION))
            if specs:
                builder = replace(p.share, share_ratio=ratio)
                steps.append(Step("4 colocated", builder, specs, "share_ratio", p.share.rate))
    for name in p.no_cache:
        builder = {**main, **p.extra}.get(name)
        if builder is not None and wanted(name) and chosen((ROUND_ROBIN,)):
            cluster = no_cache_cluster.get(name, "4 colocated, no cache")
            steps.append(Step(cluster, builder, (ROUND_ROBIN,), "no_cache", rate_of(builder)))
    if pd and wanted("pd"):
        for cluster in p.pd_clusters:
            specs = chosen((PROMPT_TREE,))
            if cluster.endswith(("basic", "caching-3")):
                specs += chosen(p.pd_peers)
            if specs:
                steps.append(Step(cluster, p.pd_workload, specs, "pd", rate_of(p.pd_workload)))
    used = {s.cluster for s in steps}
    every = clusters_for(ts)
    clusters = {k: every[k] for k in every if k in used}  # in a fixed order
    return Plan("quick" if quick else "full", clusters, steps, p.max_total_tokens)
