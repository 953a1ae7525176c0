"""The capacity-bound preset: caches smaller than the working set, with and without a host tier.

For each workload (production-stack's multi-round QA, the Mooncake conversation trace) and
each seed, the workload is built and its working set estimated (`working_set`); the median
over the seeds sizes the workers' device KV so that the working set is 2x, 4x and 8x the
cluster's. Each (workload, multiple, host tier) is one cluster of 4 colocated sim workers,
started once; on it every system runs every seed's workload, caches flushed in between, in
an order rotated per step. Workers pull prefixes from each other (`--enable-mempool-pull`)
and publish KV events to our router; the peers route as they always do. The same seed gives
every system the same workload, so ratios between systems are paired per seed.

Parts the worker or router do not offer yet (detected from their `--help`) are left out and
the results say so.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from benchmarks.harness import REPO_ROOT
from benchmarks.multiturn.cluster import (
    CACHE_AWARE,
    COST,
    PROMPT_TREE,
    ROUND_ROBIN,
    SMG_CACHE_AWARE,
    RouterSpec,
)
from benchmarks.multiturn.paired import Config, Member, PairedPlan, Prebuilt
from benchmarks.multiturn.plan import rate_of
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.trace import DEFAULT_TRACE, TraceReplay
from benchmarks.multiturn.working_set import Sizing, estimate, largest_request
from benchmarks.multiturn.workloads import SGLANG, MultiRoundQA
from benchmarks.peers import OURS
from localrun.cluster import ClusterSpec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

CAPACITY = "capacity"
CAPACITY_QUICK = "capacity-quick"
INSTANCES = 4
HOST_RATIO = 4.0  # the host tier, in device KVs (`--hicache-ratio`)

NO_PULL = RouterSpec(OURS, "prompt_tree", pull=False)
SYSTEMS = (PROMPT_TREE, COST, NO_PULL, CACHE_AWARE, ROUND_ROBIN, SMG_CACHE_AWARE)
OURS_WITH_PULLS = (PROMPT_TREE, COST)  # the systems the targets are about


@dataclass(frozen=True)
class CapacityPreset:
    name: str
    # workload name -> (seed -> builder); every builder has `rate` or `qps`
    workloads: dict[str, Callable[[int], Any]]
    multiples: tuple[float, ...] = (2.0, 4.0, 8.0)
    host_ratios: tuple[float, ...] = (0.0, HOST_RATIO)  # 0: no host tier
    seeds: tuple[int, ...] = (1, 2, 3)
    systems: tuple[RouterSpec, ...] = SYSTEMS
    time_scale: float = 1.0  # the sim's --time-scale


def full_preset(trace: Path = DEFAULT_TRACE) -> CapacityPreset:
    """About 2.5 h on 2 cores: 216 runs of 150-200 requests at 4-6 req/s."""
    return CapacityPreset(
        CAPACITY,
        {
            # production-stack's multi-round QA, scaled so that 8x still leaves an instance
            # 1.5 of the largest request: 24 users, 4 rounds, 6K-token histories
            "multi_round_qa": lambda seed: MultiRoundQA(
                24, 4, history_tokens=6000, answer_tokens=64, qps=4.0, requests=150, seed=seed
            ),
            # whole sessions of Mooncake's trace up to 8K-token prompts
            "trace": lambda seed: TraceReplay(
                trace, 200, rate=6.0, max_input_tokens=8192, max_output_tokens=64, seed=seed
            ),
        },
    )


def quick_preset(trace: Path = DEFAULT_TRACE) -> CapacityPreset:
    """About a minute: one small workload, one multiple, one seed, three systems."""
    return CapacityPreset(
        CAPACITY_QUICK,
        {
            "multi_round_qa": lambda seed: MultiRoundQA(
                12, 3, history_tokens=3000, answer_tokens=32, qps=5.0, requests=48, seed=seed
            ),
        },
        multiples=(4.0,),
        host_ratios=(HOST_RATIO,),
        seeds=(1,),
        systems=(PROMPT_TREE, NO_PULL, CACHE_AWARE),
    )


# --------------------------------------------------------------------------- what can run


def _flags(module: str) -> frozenset[str]:
    """The long options `python -m module --help` lists (empty if it cannot start)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", done.stdout))


@cache
def worker_flags() -> frozenset[str]:
    return _flags("connector.worker")


@cache
def router_flags() -> frozenset[str]:
    return _flags("router")


@dataclass(frozen=True)
class Features:
    """What the worker and router in this tree offer of the preset's needs."""

    host_tier: bool  # worker: --enable-hierarchical-cache, --hicache-ratio
    pulls: bool  # worker: --enable-mempool-pull
    no_pull_router: bool  # router: --disable-mempool-pull
    kv_events: bool  # worker: --kv-events-config; router: --kv-events-subscribe

    @classmethod
    def detect(cls) -> Features:
        worker, router = worker_flags(), router_flags()
        return cls(
            {"--enable-hierarchical-cache", "--hicache-ratio"} <= worker,
            "--enable-mempool-pull" in worker,
            "--disable-mempool-pull" in router,
            "--kv-events-config" in worker and "--kv-events-subscribe" in router,
        )

    def missing(self) -> list[str]:
        """What the run leaves out, said for the results."""
        out = []
        if not self.host_tier:
            out.append(
                "host tier: the worker has no --enable-hierarchical-cache/--hicache-ratio, "
                "so only the configurations without a host tier ran"
            )
        if not self.pulls:
            out.append(
                "pulls: the worker has no --enable-mempool-pull, so no worker pulled a "
                "prefix (pulled tokens are 0)"
            )
        if not self.no_pull_router:
            out.append("ours without pulls: the router has no --disable-mempool-pull")
        if not self.kv_events:
            out.append("KV events: the worker or router lacks the flags; our trees learn alone")
        return out


# --------------------------------------------------------------------------- the plan


@dataclass
class Sized:
    """One workload's seeds, built and estimated, and the working set that sizes it."""

    name: str
    time_scale: float
    per_seed: dict[int, Prebuilt]
    estimates: dict[int, int]  # seed -> estimated working set, tokens
    largest: int  # the largest request's prompt + answer over the seeds

    @property
    def working_set(self) -> int:
        """The seeds' median: what sizes the clusters."""
        return int(statistics.median(self.estimates.values()))


def size_workload(
    name: str, preset: CapacityPreset, vocab: Vocab, encoder: Any, on_seed: Callable[[], None]
) -> Sized:
    per_seed: dict[int, Prebuilt] = {}
    estimates: dict[int, int] = {}
    largest = 0
    for seed in preset.seeds:
        builder = preset.workloads[name](seed)
        workload = builder.build(vocab)
        planned = estimate(workload, vocab, encoder)
        workload.params = {**workload.params, "seed": seed}
        workload.api = SGLANG  # /generate: the answers' meta_info splits the cached tokens
        per_seed[seed] = Prebuilt(workload, rate_of(builder))
        estimates[seed] = planned.distinct_tokens
        largest = max(largest, largest_request(workload, planned))
        on_seed()
    return Sized(name, preset.time_scale, per_seed, estimates, largest)


def make_plan(
    preset: CapacityPreset,
    vocab: Vocab,
    encoder: Any,
    features: Features,
    workloads: set[str] | None = None,
    systems: set[str] | None = None,
    on_seed: Callable[[], None] = lambda: None,
) -> PairedPlan:
    """Build and size every workload, then one config per (workload, multiple, host tier):
    one cluster, every seed's workload at its own rate (no sustained-rate search). ValueError
    when nothing is left to run or a request does not fit an instance's KV."""
    names = [n for n in preset.workloads if workloads is None or n in workloads]
    specs = tuple(s for s in preset.systems if systems is None or s.name in systems)
    if not features.no_pull_router:
        specs = tuple(s for s in specs if s.pull)
    # without a host tier in the worker, its configurations run without one (once)
    ratios = tuple(dict.fromkeys(r if features.host_tier else 0.0 for r in preset.host_ratios))
    if not names or not specs or not ratios:
        raise ValueError("nothing to run: no workload, system or host tier configuration left")
    configs, setup = [], {}
    for name in names:
        sized = size_workload(name, preset, vocab, encoder, on_seed)
        kv: dict[str, int] = {}
        for multiple in preset.multiples:
            sizing = Sizing(sized.working_set, multiple, INSTANCES)
            sizing.check_fits(sized.largest)
            kv[f"{multiple:g}"] = sizing.instance_tokens
            for ratio in ratios:
                host = f"host tier {ratio:g}x" if ratio else "no host tier"
                spec = ClusterSpec(
                    f"cap-{name[:5]}-{multiple:g}x-h{ratio:g}",
                    colocated=INSTANCES,
                    label=f"{name} {multiple:g}x, {host}",
                    time_scale=sized.time_scale,
                    max_total_tokens=sizing.instance_tokens,
                    hicache_ratio=ratio,
                    mempool_pull=features.pulls,
                    kv_events=features.kv_events,
                )
                labels = {
                    "multiple": multiple,
                    "hicache_ratio": ratio,
                    "working_set_sizing": sized.working_set,
                    "instance_kv_tokens": sizing.instance_tokens,
                    "cluster_kv_tokens": sizing.cluster_tokens,
                    "host_kv_tokens": int(sizing.instance_tokens * ratio) * INSTANCES,
                }
                members = (Member(spec, specs),)
                seeds = dict(sized.per_seed)
                configs.append(
                    Config(spec.label, name, seeds, None, members, CACHE_AWARE, 1.0, SGLANG, labels)
                )
        setup[name] = {
            "time_scale": sized.time_scale,
            "working_set_estimates": {str(k): v for k, v in sized.estimates.items()},
            "working_set_sizing": sized.working_set,
            "largest_request_tokens": sized.largest,
            "instance_kv_tokens": kv,
        }
    search = Search()  # (unused: every config is offered its workload's own rate)
    return PairedPlan(preset.name, configs, search, features.missing(), setup)


P = TypeVar("P", bound="DataclassInstance")  # a preset with `seeds` (and `multiples`)


def narrowed(preset: P, seeds: Sequence[int] | None, multiples: Sequence[float] | None) -> P:
    """The preset with other seeds or multiples, when given."""
    if seeds:
        preset = replace(preset, seeds=tuple(dict.fromkeys(seeds)))
    if multiples:
        preset = replace(preset, multiples=tuple(dict.fromkeys(multiples)))
    return preset
