"""`--lora`: 20 LoRA adapters of Zipf popularity on 4 sim workers that hold at most 4 each,
each adapter's prompts sharing its own prefix, near what the cluster sustains.

The workload (`lora.LoraPrefix`) names an adapter per request (`lora_path`, passed through
unchanged by every router here); each adapter's requests share its system prompt and one
of its few documents. The workers serve the adapters as SGLang does (`--lora-paths`,
`--max-loaded-loras 4 --max-loras-per-batch 4`; a load costs the sim's 10 ms plus 84 MB at
2 GB/s, 52 ms, times the time scale), so a router must place the adapter and the prefix
together: 16 slots for 20 adapters. Each worker's device KV is half the hot set, as in
`--hot-prefix`. The rate is 85 % of what sglang-router's round_robin sustains on the same
workers (`sustained`), measured first on a calibration seed.

Systems: ours prompt_tree (the adapter priced per worker: `router/adapters.py`), the same
router with `--lora-load-secs 0` (adapter-blind: what the feature adds), ours lora_affinity
(llm-d's LoRA affinity scorer alone: adapter-aware, prefix-blind), sglang-router cache_aware
(adapter-blind, prefix-aware) and round_robin. Each run's adapter loads are the workers'
`/get_server_info` `lora.loads` after it less before it; before each run the workers' adapters
are put back as they were at their start (`localrun.adapters`), so every system meets the
same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn import versus
from benchmarks.multiturn.capacity import Features
from benchmarks.multiturn.cluster import CACHE_AWARE, PROMPT_TREE, ROUND_ROBIN, RouterSpec
from benchmarks.multiturn.lora import LoraPrefix
from benchmarks.multiturn.paired import Config, HotSetKV, Member, PairedPlan, selected
from benchmarks.multiturn.paired_report import Extra, Run, Target
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.versus import Column, warm_text
from benchmarks.multiturn.workloads import OPENAI
from benchmarks.peers import OURS
from benchmarks.report.seeds import configs, ratio
from benchmarks.report.table import table_section

LORA = "lora"
LORA_QUICK = "lora-quick"
INSTANCES = 4
MAX_LOADED_LORAS = 4  # per worker, and --max-loras-per-batch
LOAD = 0.85
KV_SHARE = 0.5  # a worker's device KV, as a share of the hot set
CALIBRATION_SEED = 101
SHAPE = "4 colocated"
TARGET_P99 = 0.7  # issue 38: ours' p99 TTFT at most 0.7x cache_aware's

ADAPTER_BLIND = RouterSpec(OURS, "prompt_tree", args=("--lora-load-secs", "0"), tag="lora-load 0")
LORA_AFFINITY = RouterSpec(OURS, "lora_affinity")  # llm-d's LoRA scorer alone: prefix-blind
SYSTEMS = (PROMPT_TREE, ADAPTER_BLIND, LORA_AFFINITY, CACHE_AWARE, ROUND_ROBIN)


@dataclass(frozen=True)
class LoraPreset:
    name: str
    workload: LoraPrefix  # at a nominal rate; the seed and rate are set per run
    calibration: LoraPrefix
    seeds: tuple[int, ...]
    systems: tuple[RouterSpec, ...]
    time_scale: float
    search: Search = field(default_factory=Search)
    load: float = LOAD


def full_preset() -> LoraPreset:
    """About 15 min on 2 cores: a calibration of at most 5 steps of 120 requests, then 15
    runs (5 systems x 3 seeds) of 240 requests of 1.5-4.5K-token prompts."""
    workload = LoraPrefix(requests=240)
    return LoraPreset(
        LORA,
        workload,
        replace(workload, seed=CALIBRATION_SEED, requests=120),
        seeds=(1, 2, 3),
        systems=SYSTEMS,
        time_scale=4.0,
        search=Search(max_steps=5),
    )


def quick_preset() -> LoraPreset:
    """About a minute: fewer, shorter prompts, ours against lora_affinity and cache_aware,
    one seed, a two-step calibration."""
    workload = LoraPrefix(
        adapters=8,
        documents=2,
        system_min_tokens=200,
        system_max_tokens=400,
        document_min_tokens=400,
        document_max_tokens=800,
        question_max_tokens=60,
        answer_tokens=8,
        requests=40,
    )
    return LoraPreset(
        LORA_QUICK,
        workload,
        replace(workload, seed=CALIBRATION_SEED, requests=30),
        seeds=(1,),
        systems=(PROMPT_TREE, LORA_AFFINITY, CACHE_AWARE),
        time_scale=4.0,
        search=Search(max_steps=2, factor=1.6),
    )


def worker_args(builder: LoraPrefix) -> tuple[str, ...]:
    """The workers' LoRA flags: every adapter registered (paths are names: the sim loads no
    weights), at most MAX_LOADED_LORAS loaded and as many in one batch."""
    paths = [f"{name}=/adapters/{name}" for name in builder.adapter_names]
    limit = str(MAX_LOADED_LORAS)
    return ("--lora-paths", *paths, "--max-loaded-loras", limit, "--max-loras-per-batch", limit)


def make_plan(
    preset: LoraPreset,
    vocab: Vocab,
    features: Features,
    systems: set[str] | None = None,
    on_seed: Callable[[], None] = lambda: None,
    known: dict[str, dict[str, Any]] | None = None,
) -> PairedPlan:
    """Every seed's workload built, the KV sized from their hot sets (or as `known`, an
    earlier run's setup, sized it); one config. ValueError when nothing is left to run."""
    builders = {seed: replace(preset.workload, seed=seed) for seed in preset.seeds}
    sized = HotSetKV.of_builders(builders, vocab, known, KV_SHARE, INSTANCES, on_seed)
    name, hot_set, kv = sized.name, sized.hot_set, sized.kv
    specs = tuple(s for s in preset.systems if selected(systems, s.name, None))
    if not specs:
        raise ValueError("nothing to run: no system of the preset has those names")
    adapters = preset.workload.adapters
    cluster = sized.cluster(
        "lora-c4",
        SHAPE,
        preset.time_scale,
        features,
        colocated=INSTANCES,
        worker_args=worker_args(preset.workload),
    )
    key = f"{name}, {SHAPE}, {adapters} adapters"
    labels = {
        "shape": SHAPE,
        "instance_kv_tokens": kv,
        "hot_set_tokens": hot_set,
        "adapters": adapters,
        "max_loaded_loras": MAX_LOADED_LORAS,
    }
    config = Config(
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
    setup = {
        key: {
            **sized.setup(preset.time_scale),
            "adapters": adapters,
            "max_loaded_loras": MAX_LOADED_LORAS,
            "text": (
                f"{SHAPE} sim workers, time scale {preset.time_scale:g}, {adapters} LoRA "
                f"adapters registered on each, at most {MAX_LOADED_LORAS} loaded and "
                f"{MAX_LOADED_LORAS} in a batch (a load: 52 ms of modelled time, "
                f"{0.052 * preset.time_scale * 1e3:.0f} ms of wall time at this scale); "
                f"{sized.kv_text(KV_SHARE)}; offered at {preset.load:.0%} of the sustained rate."
            ),
        }
    }
    return PairedPlan(preset.name, [config], preset.search, features.missing(), setup)


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """Issue 38's: ours prompt_tree's p99 TTFT at most 0.7x sglang-router cache_aware's."""
    return [
        Target(
            "p99_vs_cache_aware",
            f"p99 TTFT / {CACHE_AWARE.name}'s",
            PROMPT_TREE.name,
            "ttft_p99_s",
            "<=",
            TARGET_P99,
            CACHE_AWARE.name,
        )
    ]


# --------------------------------------------------------------------------- the report


def lora_loads(run: Run) -> float | None:
    """Adapter loads the workers made during the run (not the ones at their start)."""
    workers = run.get("per_worker") or []
    if not any("lora_loads" in w for w in workers):
        return None
    return sum(float(w.get("lora_loads") or 0.0) for w in workers)


def loads_per_request(run: Run) -> float | None:
    return ratio(lora_loads(run), run.get("requests"))


def evictions_per_request(run: Run) -> float | None:
    workers = run.get("per_worker") or []
    if not any("lora_evictions" in w for w in workers):
        return None
    evicted = sum(float(w.get("lora_evictions") or 0.0) for w in workers)
    return ratio(evicted, run.get("requests"))


LORA_COLUMNS = (
    Column("lora_loads_per_request", "adapter loads / request", loads_per_request),
    Column("lora_evictions_per_request", None, evictions_per_request),
)


def system_rows(runs: Sequence[Run], config: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per system of `config`: TTFT, hit, adapter loads per request, and its ratios to
    cache_aware's per seed with their median; and the same as figures for results.json."""
    return versus.system_rows(runs, config, CACHE_AWARE.name, "cache_aware", LORA_COLUMNS)


def extra(out_dir: Path, figures: dict[str, Any]) -> Extra:
    """Per system: the issue's figures (mean and p99 TTFT, hit, adapter loads per request)
    and the ratios to cache_aware in every seed."""
    runs = figures["runs"]
    lines: list[str] = []
    tables: dict[str, Any] = {}
    for config in configs(runs):
        rows, per_system = system_rows(runs, config)
        tables[config] = per_system
        lines += table_section(
            f"Adapters and latency: {config}",
            rows,
            "Medians [min..max] over the seeds; ratios to sglang-router cache_aware's taken "
            "within each seed (the same requests on the same workers), listed seed by seed, "
            "then their median. Adapter loads: the workers' `lora.loads` after the run less "
            "before it, over the requests." + warm_text(rows),
        )
    return Extra("lora", lines, tables, [])
