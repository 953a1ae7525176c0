"""`--hot-prefix`: a tool-agent-like workload of hot shared prefixes, at 85 % of what the
cluster sustains, on 4 colocated sim workers and on 2P2D.

The workload (`hot_prefix.HotPrefix`, or any Mooncake-format trace replayed open-loop with
`--trace`) sends long shared prefixes of Zipf popularity with short unique suffixes through
`/v1/completions`. Each worker's device KV is half the workload's hot set (the prompt pages
at least two requests share; the seeds' median), so the cluster holds the hot set twice over
but one worker holds only half of it: a router that sends every hot prefix to one worker
runs out of room there, and one that ignores locality recomputes. The rate is 85 % of what
the cluster sustains under sglang-router's round_robin (locality-blind, evenly spread: a
reference that does not move when our router changes), measured first on the same workers
(`sustained`).

Clusters: 4 colocated workers (pulls between them and KV events to our router, as in
`--capacity`), and 2P2D in PD-Caching-1, the mode SGLang's own PD servers run (each
prefill caches its prompts; a single-turn request's answer is never in a later prompt, so
decode caching or write-back has nothing to add). Every system of a cluster gets the same
requests on the same workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.capacity import Features
from benchmarks.multiturn.cluster import (
    CACHE_AWARE,
    COST,
    PD_CACHE_AWARE,
    PD_ROUND_ROBIN,
    PD_SMG,
    PROMPT_TREE,
    ROUND_ROBIN,
    SMG_CACHE_AWARE,
    RouterSpec,
)
from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.paired import (
    Config,
    HotSetKV,
    Member,
    PairedPlan,
    selected,
    system_label,
)
from benchmarks.multiturn.paired_report import FLOOR, Run, Target
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.trace import OpenLoopTrace
from benchmarks.multiturn.workloads import OPENAI

HOT_PREFIX = "hot-prefix"
HOT_PREFIX_QUICK = "hot-prefix-quick"
INSTANCES = 4
LOAD = 0.85
KV_SHARE = 0.5  # a worker's device KV, as a share of the hot set
CALIBRATION_SEED = 101  # the calibration workload's: no measured run uses it
COLOCATED = "4 colocated"
PD_2P2D = "2P2D"

SYSTEMS: dict[str, tuple[RouterSpec, ...]] = {
    COLOCATED: (PROMPT_TREE, COST, CACHE_AWARE, ROUND_ROBIN, SMG_CACHE_AWARE),
    PD_2P2D: (PROMPT_TREE, COST, PD_CACHE_AWARE, PD_ROUND_ROBIN, PD_SMG),
}
# ours on a second 2P2D cluster in PD-Caching-2: decodes cache what they receive (a prefill
# then sends a decode only the pages it lacks) and serve it to the prefills' pulls; requests
# are single turns, so -3's write-back of each answer would only churn the prefills' caches.
# The peers' SGLang-like workers have no such mode.
DECODES_CACHE = "caching-2"
OURS_ON_DECODES_CACHE = (PROMPT_TREE,)
# the systems targets compare ours with, per shape: (cache_aware, round_robin)
BASELINES = {
    COLOCATED: (CACHE_AWARE, ROUND_ROBIN, None),
    PD_2P2D: (PD_CACHE_AWARE, PD_ROUND_ROBIN, "caching-1"),
}


@dataclass(frozen=True)
class HotPrefixPreset:
    name: str
    workload: Callable[[int], Any]  # seed -> builder (has `rate`)
    calibration: Any  # the calibration workload's builder
    seeds: tuple[int, ...]
    shapes: tuple[str, ...]
    systems: dict[str, tuple[RouterSpec, ...]]
    time_scale: float
    search: Search = field(default_factory=Search)
    load: float = LOAD


def full_preset(trace: Path | None = None) -> HotPrefixPreset:
    """About 30 min a seed on 2 cores: 10 runs of 300 requests of 4-16K-token prompts,
    and the two calibrations."""
    workload = _workload(trace, HotPrefix(requests=300))
    return HotPrefixPreset(
        HOT_PREFIX,
        workload,
        replace(workload(CALIBRATION_SEED), requests=120),
        seeds=(1, 2, 3),
        shapes=(COLOCATED, PD_2P2D),
        systems=SYSTEMS,
        # 5x slower GPUs: the cluster then sustains 2-3 requests/s of 10K-token prompts,
        # about 0.1 CPU s each for the client, a router and the workers (`CPU ms/req`),
        # which 2 cores serve without becoming the limit.
        time_scale=5.0,
    )


def quick_preset(trace: Path | None = None) -> HotPrefixPreset:
    """About 2 minutes: small prefixes, 4 colocated, three systems, one seed."""
    small = HotPrefix(
        prefixes=30,
        prefix_min_tokens=2048,
        prefix_max_tokens=4096,
        suffix_max_tokens=200,
        answer_tokens=16,
        requests=60,
    )
    workload = _workload(trace, small)
    return HotPrefixPreset(
        HOT_PREFIX_QUICK,
        workload,
        replace(workload(CALIBRATION_SEED), requests=40),
        seeds=(1,),
        shapes=(COLOCATED,),
        systems={COLOCATED: (PROMPT_TREE, CACHE_AWARE, ROUND_ROBIN)},
        time_scale=4.0,
        search=Search(max_steps=4, factor=1.6),
    )


def _workload(trace: Path | None, synthetic: HotPrefix) -> Callable[[int], Any]:
    """seed -> the synthetic workload, or `trace` replayed open-loop (as many requests)."""
    if trace is None:
        return lambda seed: replace(synthetic, seed=seed)
    return lambda seed: OpenLoopTrace(trace, requests=synthetic.requests, seed=seed)


def make_plan(
    preset: HotPrefixPreset,
    vocab: Vocab,
    features: Features,
    systems: set[str] | None = None,
    on_seed: Callable[[], None] = lambda: None,
    known: dict[str, dict[str, Any]] | None = None,
) -> PairedPlan:
    """Build every seed's workload, size the KV from their hot sets (or as `known`, an
    earlier run's setup, sized it), one config per shape. ValueError when nothing is left to
    run or a request does not fit a worker."""
    builders = {seed: preset.workload(seed) for seed in preset.seeds}
    sized = HotSetKV.of_builders(builders, vocab, known, KV_SHARE, INSTANCES, on_seed)
    name, hot_set, kv = sized.name, sized.hot_set, sized.kv
    configs = []
    for shape in preset.shapes:
        caching = "caching-1" if shape == PD_2P2D else None
        specs = tuple(s for s in preset.systems[shape] if selected(systems, s.name, caching))
        pd = shape == PD_2P2D
        ours_c2 = tuple(
            s for s in OURS_ON_DECODES_CACHE if pd and selected(systems, s.name, DECODES_CACHE)
        )
        if not specs and not ours_c2:
            continue
        spec = sized.cluster(
            f"hp-{'2p2d' if pd else 'c4'}",
            shape,
            preset.time_scale,
            features,
            colocated=0 if pd else INSTANCES,
            prefills=2 if pd else 0,
            decodes=2 if pd else 0,
            caching=caching,
        )
        members = [Member(spec, specs)] if specs else []
        if ours_c2:  # ours with MemServe's PD caching: the decodes' KV as a pool too
            c2 = replace(spec, name="hp-2p2d-c2", caching=DECODES_CACHE)
            members.append(Member(c2, ours_c2))
        reference = BASELINES[shape][1]
        labels = {"shape": shape, "instance_kv_tokens": kv, "hot_set_tokens": hot_set}
        configs.append(
            Config(
                f"{name}, {shape}",
                name,
                builders,
                preset.calibration,
                tuple(members),
                reference,
                preset.load,
                OPENAI,
                labels,
            )
        )
    if not configs:
        raise ValueError("nothing to run: no system of the preset has those names")
    setup = {
        c.key: {
            **sized.setup(preset.time_scale),
            "text": (
                f"{c.members[0].spec.label} sim workers, time scale {preset.time_scale:g}; "
                f"device KV {kv:,} tokens a worker = {KV_SHARE:g} x the hot set of "
                f"{hot_set:,} tokens (prompt pages two or more requests share; "
                f"{'as the run the rates came from sized it; ' if sized.earlier else ''}median "
                f"of seeds {sized.seeds_text()}); offered at "
                f"{preset.load:.0%} of the sustained rate."
            ),
        }
        for c in configs
    }
    return PairedPlan(preset.name, configs, preset.search, features.missing(), setup)


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """For ours prompt_tree and cost: p99 TTFT <= 0.6x sglang-router cache_aware's, <=
    round_robin's and <= 1.5x the floor's; mean <= 0.8x round_robin's; no worker with less
    than half the mean share of busy time."""
    shape = PD_2P2D if config.endswith(PD_2P2D) else COLOCATED
    cache_aware, round_robin, mode = BASELINES[shape]
    ca, rr = system_label(cache_aware.name, mode), system_label(round_robin.name, mode)
    out = []
    mine_labels = [system_label(ours.name, mode) for ours in (PROMPT_TREE, COST)]
    if shape == PD_2P2D:
        mine_labels += [system_label(o.name, DECODES_CACHE) for o in OURS_ON_DECODES_CACHE]
    for mine in mine_labels:
        out += [
            Target("p99_vs_cache_aware", f"p99 TTFT / {ca}'s", mine, "ttft_p99_s", "<=", 0.6, ca),
            Target("p99_vs_round_robin", f"p99 TTFT / {rr}'s", mine, "ttft_p99_s", "<=", 1.0, rr),
            Target(
                "p99_vs_floor", "p99 TTFT / the floor's p99", mine, "ttft_p99_s", "<=", 1.5, FLOOR
            ),
            Target(
                "mean_vs_round_robin", f"mean TTFT / {rr}'s", mine, "ttft_mean_s", "<=", 0.8, rr
            ),
            Target(
                "busy_balance",
                "least busy worker's busy time / its role's mean",
                mine,
                "busy_balance",
                ">=",
                0.5,
            ),
        ]
    return out
