"""What a run compares: clusters, systems, workloads and request rates, per preset.

Every cluster is started once; the systems compared on it run one after another on the same
workers, caches flushed in between, in an order rotated per workload so a drift in the
machine's speed does not always favour the same system.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.cluster import OURS, SGLANG_ROUTER, SMG, ClusterSpec, RouterSpec
from benchmarks.multiturn.trace import DEFAULT_TRACE, TraceReplay
from benchmarks.multiturn.workloads import LooGLELike, MultiRoundQA, ReActLike, ShareGPTLike

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

ALL_SYSTEMS = tuple(RouterSpec(OURS, p) for p in OUR_POLICIES) + tuple(
    RouterSpec(peer, p) for peer in (SGLANG_ROUTER, SMG) for p in PEER_POLICIES
)
KEY_SYSTEMS = (
    RouterSpec(OURS, "prompt_tree"),
    RouterSpec(OURS, "cost"),
    RouterSpec(OURS, "session"),
    RouterSpec(OURS, "round_robin"),
    RouterSpec(SGLANG_ROUTER, "cache_aware"),
    RouterSpec(SGLANG_ROUTER, "round_robin"),
    RouterSpec(SMG, "cache_aware"),
)
QUICK_SYSTEMS = (
    RouterSpec(OURS, "prompt_tree"),
    RouterSpec(OURS, "round_robin"),
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
    group: str  # main | rate_sweep | share_ratio | no_cache | pd
    rate: float


@dataclass
class Plan:
    preset: str
    clusters: dict[str, ClusterSpec]
    steps: list[Step]
    max_total_tokens: int | None
    time_scale: float = 1.0
    notes: list[str] = field(default_factory=list)

    def runs(self) -> int:
        return sum(len(s.systems) for s in self.steps)


def rate_of(builder: Any) -> float:
    return float(getattr(builder, "qps", None) or builder.rate)


def with_rate(builder: Any, rate: float) -> Any:
    return replace(builder, qps=rate) if hasattr(builder, "qps") else replace(builder, rate=rate)


def clusters_for(pd: bool) -> dict[str, ClusterSpec]:
    out = {
        "4 colocated": ClusterSpec("c4", colocated=4, label="4 colocated, caching"),
        "4 colocated, no cache": ClusterSpec(
            "c4nc", colocated=4, radix_cache=False, label="4 colocated, no caching"
        ),
    }
    if pd:
        out.update(
            {
                "2 colocated, no cache": ClusterSpec(
                    "c2nc", colocated=2, radix_cache=False, label="PD"
                ),
                "2 colocated": ClusterSpec("c2", colocated=2, label="PD-CC"),
                "1P1D basic": ClusterSpec(
                    "pd-basic", prefills=1, decodes=1, caching="basic", label="1P1D"
                ),
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
        )
    return out


def make_plan(
    quick: bool,
    trace: Path = DEFAULT_TRACE,
    pd: bool = True,
    workloads: set[str] | None = None,
    systems: set[str] | None = None,
) -> Plan:
    """The preset's steps; `workloads` / `systems` (names) narrow it."""
    if quick:
        main = {
            "trace": TraceReplay(
                trace, sessions=40, rate=6.0, max_input_tokens=16384, max_output_tokens=64
            ),
            "multi_round_qa": MultiRoundQA(users=10, rounds=3, history_tokens=2000, qps=4.0),
        }
        extra: dict[str, Any] = {}
        main_systems: tuple[RouterSpec, ...] = QUICK_SYSTEMS
        extra_systems: tuple[RouterSpec, ...] = ()
        sweep_rates: tuple[float, ...] = ()
        sweep_systems: tuple[RouterSpec, ...] = ()
        share = LooGLELike(documents=5, questions=3, doc_tokens=3000, rate=4.0)
        share_ratios: tuple[int, ...] = (1, 3)
        pd_workload: Any = ShareGPTLike(sessions=10, mean_turns=4, max_turns=5, rate=4.0)
        pd_clusters = ("1P1D basic", "1P1D caching-3")
        pd_peers: tuple[RouterSpec, ...] = ()
        no_cache = ("multi_round_qa",)
        max_total_tokens: int | None = 49152
    else:
        main = {
            "trace": TraceReplay(trace, sessions=150, rate=2.0),
            "multi_round_qa": MultiRoundQA(),
        }
        extra = {
            "sharegpt": ShareGPTLike(),
            "loogle": LooGLELike(),
            "react": ReActLike(),
        }
        main_systems = ALL_SYSTEMS
        extra_systems = KEY_SYSTEMS
        sweep_rates = (2.0, 6.0)
        sweep_systems = (
            PROMPT_TREE,
            SESSION,
            ROUND_ROBIN,
            RouterSpec(SGLANG_ROUTER, "cache_aware"),
            RouterSpec(SGLANG_ROUTER, "round_robin"),
        )
        share = LooGLELike()
        share_ratios = (1, 2, 4)
        pd_workload = ShareGPTLike(sessions=40)
        pd_clusters = (
            "2 colocated, no cache",
            "2 colocated",
            "1P1D basic",
            "1P1D caching-1",
            "1P1D caching-2",
            "1P1D caching-3",
        )
        pd_peers = (RouterSpec(SGLANG_ROUTER, "round_robin"),)
        no_cache = ("trace", "multi_round_qa", "sharegpt", "loogle", "react")
        max_total_tokens = None

    def wanted(name: str) -> bool:
        return workloads is None or name in workloads

    def chosen(specs: tuple[RouterSpec, ...]) -> tuple[RouterSpec, ...]:
        return tuple(s for s in specs if systems is None or s.name in systems)

    steps: list[Step] = []
    for name, builder in {**main, **extra}.items():
        if not wanted(name):
            continue
        specs = chosen(main_systems if name in main else extra_systems)
        if specs:
            steps.append(Step("4 colocated", builder, specs, "main", rate_of(builder)))
    if wanted("multi_round_qa"):
        for rate in sweep_rates:
            builder = with_rate(main["multi_round_qa"], rate)
            specs = chosen(sweep_systems)
            if specs:
                steps.append(Step("4 colocated", builder, specs, "rate_sweep", rate))
    if wanted("share_ratio"):
        for ratio in share_ratios:
            specs = chosen((PROMPT_TREE, SESSION))
            if specs:
                builder = replace(share, share_ratio=ratio)
                steps.append(Step("4 colocated", builder, specs, "share_ratio", share.rate))
    for name in no_cache:
        builder = {**main, **extra}.get(name)
        if builder is not None and wanted(name) and chosen((ROUND_ROBIN,)):
            steps.append(
                Step("4 colocated, no cache", builder, (ROUND_ROBIN,), "no_cache", rate_of(builder))
            )
    if pd and wanted("pd"):
        for cluster in pd_clusters:
            specs: tuple[RouterSpec, ...] = (PROMPT_TREE,)
            if cluster.startswith("1P1D") and cluster.endswith(("basic", "caching-3")):
                specs += pd_peers
            steps.append(Step(cluster, pd_workload, specs, "pd", rate_of(pd_workload)))
    used = {s.cluster for s in steps}
    clusters = {k: v for k, v in clusters_for(pd).items() if k in used}
    return Plan("quick" if quick else "full", clusters, steps, max_total_tokens)
