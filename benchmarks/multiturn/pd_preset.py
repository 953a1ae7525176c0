"""`--pd`: several prefills. 2P2D and 3P1D sim clusters, each caching mode its own cluster of
the same shape and KV, at 80 % of what the cluster sustains.

Workloads as `--capacity` builds them: production-stack's multi-round QA and whole sessions
of the Mooncake conversation trace, sent to SGLang's /generate (the answers' meta_info split
the cached tokens). Each instance's device KV is sized so the workload's working set is 2x
and 4x the cluster's (all four instances' KV; `working_set`). The prefills of the modes that
cache pull a longer prefix from a holder our router names (MemPool), as a hot-prefix run's do.

Systems: ours `prompt_tree` on PD-Caching-3 (workers `--pd-caching caching-3`: the decode
writes its KV back to the prefill), on PD-Caching-1 and on PD-Basic; sglang-router and smg
in PD mode (`--pd-disaggregation --prefill URL BOOT ... --decode URL ... --prefill-policy
cache_aware --decode-policy power_of_two`) on PD-Caching-1, which is how SGLang 0.5.23
runs: each prefill caches its own prompts, no decode-to-prefill write-back. The caching
mode is a worker flag, so a (shape, workload, multiple) is three clusters started one after
another with the same shape, KV and requests. The sustained rate is measured on the
PD-Caching-1 cluster with sglang-router PD, the baseline of the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.capacity import CapacityPreset, Features, size_workload
from benchmarks.multiturn.capacity import full_preset as capacity_full
from benchmarks.multiturn.capacity import quick_preset as capacity_quick
from benchmarks.multiturn.cluster import PD_CACHE_AWARE, PD_SMG, PROMPT_TREE, RouterSpec
from benchmarks.multiturn.paired import (
    MODE_LABELS,
    Config,
    Member,
    PairedPlan,
    earlier_sizing,
    selected,
    system_label,
)
from benchmarks.multiturn.paired_report import Run, Target
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.working_set import Sizing
from benchmarks.multiturn.workloads import SGLANG
from localrun.cluster import ClusterSpec

PD = "pd"
PD_QUICK = "pd-quick"
INSTANCES = 4
LOAD = 0.8
CALIBRATION_SEED = 101
SHAPES = {"2P2D": (2, 2), "3P1D": (3, 1)}

# caching mode -> the systems on its cluster; the first mode's cluster is calibrated
MODES: dict[str, tuple[RouterSpec, ...]] = {
    "caching-1": (PROMPT_TREE, PD_CACHE_AWARE, PD_SMG),
    "caching-3": (PROMPT_TREE,),
    "basic": (PROMPT_TREE,),
}
OURS_C3 = system_label(PROMPT_TREE.name, "caching-3")


def for_shape(spec: RouterSpec, decodes: int) -> RouterSpec:
    """The system as it can run with this many decodes: sglang-router (and smg) refuse
    power_of_two over a single decode ("requires at least 2 decode workers"), where every
    decode policy picks the same worker; it then runs round_robin."""
    if decodes < 2 and spec.decode_policy == "power_of_two":
        return replace(spec, decode_policy="round_robin")
    return spec


def baseline(config: str) -> str:
    """The label of the config's sglang-router PD run (its shape named in the key)."""
    decodes = next((d for shape, (_, d) in SHAPES.items() if f", {shape}," in config), 2)
    return system_label(for_shape(PD_CACHE_AWARE, decodes).name, "caching-1")


@dataclass(frozen=True)
class PDPreset:
    name: str
    workloads: dict[str, Callable[[int], Any]]  # name -> (seed -> builder)
    calibration: dict[str, dict[str, Any]]  # name -> fields replaced in the calibration seed's
    shapes: tuple[str, ...]
    multiples: tuple[float, ...]
    modes: dict[str, tuple[RouterSpec, ...]]
    seeds: tuple[int, ...]
    time_scale: float
    search: Search = field(default_factory=Search)
    load: float = LOAD
    # prefills pull a longer prefix our router names a holder of (modes that cache only)
    pulls: bool = True


def full_preset(trace: Path | None = None) -> PDPreset:
    """About 75 min a seed on 2 cores: 40 runs of 150-200 requests and 8 calibrations."""
    return PDPreset(
        PD,
        dict(capacity_full(*([trace] if trace else [])).workloads),
        {"multi_round_qa": {"requests": 80}, "trace": {"sessions": 100}},
        tuple(SHAPES),
        (2.0, 4.0),
        MODES,
        (1, 2, 3),
        # Twice slower GPUs: saturating 2-3 prefills then takes 2-4 requests/s of 6-8K-token
        # prompts, which 2 cores serve without the client or routers becoming the limit.
        time_scale=2.0,
    )


def quick_preset(trace: Path | None = None) -> PDPreset:
    """About 2.5 minutes: small multi-round QA on 2P2D, caching-1 (ours, sglang-router PD)
    and caching-3 (ours), one seed."""
    return PDPreset(
        PD_QUICK,
        dict(capacity_quick(*([trace] if trace else [])).workloads),
        {"multi_round_qa": {"requests": 30}},
        ("2P2D",),
        (2.0,),
        {"caching-1": (PROMPT_TREE, PD_CACHE_AWARE), "caching-3": (PROMPT_TREE,)},
        (1,),
        time_scale=2.0,
        search=Search(max_steps=4, factor=1.6),
    )


def make_plan(
    preset: PDPreset,
    vocab: Vocab,
    encoder: Any,
    features: Features,
    workloads: set[str] | None = None,
    systems: set[str] | None = None,
    on_seed: Callable[[], None] = lambda: None,
    known: dict[str, dict[str, Any]] | None = None,
) -> PairedPlan:
    """Build and size every workload's seeds (or as `known`, an earlier run's setup, sized
    it), then one config per (workload, shape, multiple) with one member cluster per caching
    mode. ValueError when nothing is left to run or a request does not fit an instance."""
    names = [n for n in preset.workloads if workloads is None or n in workloads]
    sizing_preset = CapacityPreset(
        preset.name, preset.workloads, seeds=preset.seeds, time_scale=preset.time_scale
    )
    configs: list[Config] = []
    setup: dict[str, Any] = {}
    for name in names:
        sized = size_workload(name, sizing_preset, vocab, encoder, on_seed)
        earlier = earlier_sizing(known, name, "working_set_sizing")
        working_set = earlier or sized.working_set
        calibration = replace(
            preset.workloads[name](CALIBRATION_SEED), **preset.calibration.get(name, {})
        )
        for shape in preset.shapes:
            prefills, decodes = SHAPES[shape]
            for multiple in preset.multiples:
                sizing = Sizing(working_set, multiple, INSTANCES)
                sizing.check_fits(sized.largest)
                members = []
                for mode, mode_systems in preset.modes.items():
                    specs = tuple(
                        for_shape(s, decodes)
                        for s in mode_systems
                        if selected(systems, s.name, mode)
                    )
                    if not specs:
                        continue
                    spec = ClusterSpec(
                        f"pd-{shape.lower()}-{name[:5]}-{multiple:g}x-{mode}",
                        prefills=prefills,
                        decodes=decodes,
                        caching=mode,
                        label=f"{shape} {MODE_LABELS[mode]}",
                        time_scale=preset.time_scale,
                        max_total_tokens=sizing.instance_tokens,
                        kv_events=features.kv_events,
                        mempool_pull=preset.pulls and features.pulls and mode != "basic",
                    )
                    members.append(Member(spec, specs))
                if not members:
                    continue
                key = f"{name}, {shape}, {multiple:g}x"
                labels = {
                    "shape": shape,
                    "multiple": multiple,
                    "instance_kv_tokens": sizing.instance_tokens,
                    "cluster_kv_tokens": sizing.cluster_tokens,
                    "working_set_sizing": working_set,
                }
                configs.append(
                    Config(
                        key,
                        name,
                        {seed: preset.workloads[name](seed) for seed in preset.seeds},
                        calibration,
                        tuple(members),
                        for_shape(PD_CACHE_AWARE, decodes),
                        preset.load,
                        SGLANG,
                        labels,
                    )
                )
                setup[key] = {
                    "working_set_estimates": {str(k): v for k, v in sized.estimates.items()},
                    "working_set_sizing": working_set,
                    "largest_request_tokens": sized.largest,
                    "instance_kv_tokens": sizing.instance_tokens,
                    "time_scale": preset.time_scale,
                    "text": (
                        f"{shape} ({prefills} prefills, {decodes} decodes), one cluster per "
                        f"caching mode ({', '.join(m.spec.caching or '' for m in members)}), "
                        f"time scale {preset.time_scale:g}; device KV {sizing.instance_tokens:,} "
                        f"tokens an instance, {sizing.cluster_tokens:,} in the cluster, for a "
                        f"working set of {working_set:,} (estimated, median of the seeds"
                        f"{' of the run the rates came from' if earlier else ''}): "
                        f"{multiple:g}x; offered at {preset.load:.0%} of the rate "
                        "sglang-router PD sustains on the PD-Caching-1 cluster."
                    ),
                }
    if not configs:
        raise ValueError("nothing to run: no workload or system of the preset is left")
    return PairedPlan(preset.name, configs, preset.search, features.missing(), setup)


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """Ours on PD-Caching-3 against sglang-router PD (PD-Caching-1): mean TTFT <= 0.6x, p99
    <= 0.75x, prefill hit ratio >= 1.25x."""
    theirs = baseline(config)
    return [
        Target(
            "mean_vs_sglang_pd",
            f"mean TTFT / {theirs}'s",
            OURS_C3,
            "ttft_mean_s",
            "<=",
            0.6,
            theirs,
        ),
        Target(
            "p99_vs_sglang_pd", f"p99 TTFT / {theirs}'s", OURS_C3, "ttft_p99_s", "<=", 0.75, theirs
        ),
        Target(
            "hit_vs_sglang_pd",
            f"prefill hit ratio / {theirs}'s",
            OURS_C3,
            "reuse_ratio",
            ">=",
            1.25,
            theirs,
        ),
    ]
