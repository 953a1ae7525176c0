"""`--sweep`: a robustness sweep (issue 37): ours `prompt_tree` and `cost` against
sglang-router cache_aware and round_robin over workloads and engines no single preset covers.

The workload is `hot_prefix.HotPrefix` (shared prefixes of Zipf popularity, short unique
suffixes, independent requests, open-loop Poisson arrivals). A cell sets its Zipf exponent,
its number of prefixes, their length (uniform in 0.75..1.25 x the cell's), completions or
chats, the load (a share of the rate the cluster sustains under round_robin, measured first
on the same workers, `sustained`) and the engines: 4 colocated sim workers at the sim's H100
speed, 4x or 10x slower, or mixed (two at H100 speed, two 4x slower: a per-worker time
scale; our router is told the fast ones' speed and learns the slow ones'). Each worker's
device KV is half the cell's hot set (as in `--hot-prefix`), so a router that piles every hot
prefix on one worker runs out of room and one that ignores locality recomputes.

The full cartesian product is far too slow on 2 cores, so the cells are one factor at a time
around a base cell (Zipf 1.0, 100 prefixes of 4K tokens, text prompts, 85 % load, H100
speed): each factor at its extremes and middle (the middle is the base), and the engine
cells. Every system of a cell gets the same requests on the same workers, per seed; ratios
to cache_aware are taken within a seed, then their median over the seeds is the cell's.
Cells that differ only in load share the base's measured sustained rate (`Config.rate_key`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.multiturn.capacity import Features
from benchmarks.multiturn.capacity import narrowed as capacity_narrowed
from benchmarks.multiturn.cluster import RouterSpec
from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.hot_prefix_preset import (
    CACHE_AWARE,
    CALIBRATION_SEED,
    COST,
    KV_SHARE,
    PROMPT_TREE,
    ROUND_ROBIN,
)
from benchmarks.multiturn.paired import Config, Member, PairedPlan, selected
from benchmarks.multiturn.paired_report import Run, Target
from benchmarks.multiturn.sustained import Search
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.working_set import Sizing, hot_set_tokens, planned_prompt_ids
from benchmarks.multiturn.workloads import CHAT, COMPLETION, OPENAI, Workload
from localrun.cluster import ClusterSpec

SWEEP = "sweep"  # the preset's name; its quick variant is sweep-quick
INSTANCES = 4
SYSTEMS = (PROMPT_TREE, COST, CACHE_AWARE, ROUND_ROBIN)
OURS_SYSTEMS = (PROMPT_TREE, COST)

H100, SLOW_4X, SLOW_10X, MIXED = "H100", "4x slower", "10x slower", "mixed"
# each worker's time scale (the sim's --time-scale: k = k times slower than its H100)
ENGINES: dict[str, tuple[float, ...]] = {
    H100: (1.0,) * INSTANCES,
    SLOW_4X: (4.0,) * INSTANCES,
    SLOW_10X: (10.0,) * INSTANCES,
    MIXED: (1.0, 1.0, 4.0, 4.0),
}
ENGINE_TEXT = {
    H100: "4 colocated, H100 speed",
    SLOW_4X: "4 colocated, 4x slower",
    SLOW_10X: "4 colocated, 10x slower",
    MIXED: "4 colocated, mixed: 2 at H100 speed, 2 4x slower",
}

# The targets: ours against cache_aware within a seed, the median over the seeds.
NO_WORSE = 1.05  # every cell: mean and p99 TTFT at most this x cache_aware's
HOT_P99 = 0.8  # hot prefixes at HOT_LOAD and above: p99 at most this x cache_aware's
MIXED_MEAN = 0.8  # the mixed cluster: mean at most this x cache_aware's
HOT_ZIPF = 1.0  # "hot prefixes": a Zipf exponent of at least this (the base's)
HOT_LOAD = 0.85


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: a workload, a load and the engines."""

    name: str
    factor: str  # the factor this cell moves away from the base ("base": none)
    zipf: float = 1.0
    prefixes: int = 100
    prefix_tokens: int = 4096
    route: str = COMPLETION  # COMPLETION (text prompts) or CHAT
    load: float = 0.85
    engine: str = H100

    @property
    def rate_key(self) -> str:
        """Everything but the load: cells that share it share their sustained rate."""
        return f"{self.zipf:g}/{self.prefixes}/{self.prefix_tokens}/{self.route}/{self.engine}"

    @property
    def hot(self) -> bool:
        """Hot prefixes at high load: where the tighter p99 target applies."""
        return self.zipf >= HOT_ZIPF and self.load >= HOT_LOAD

    def builder(self, sizes: HotPrefix, seed: int) -> HotPrefix:
        return replace(
            sizes,
            prefixes=self.prefixes,
            prefix_min_tokens=self.prefix_tokens * 3 // 4,
            prefix_max_tokens=self.prefix_tokens * 5 // 4,
            zipf_exponent=self.zipf,
            route=self.route,
            seed=seed,
        )

    def describe(self) -> str:
        prompts = "chats" if self.route == CHAT else "text prompts"
        return (
            f"Zipf {self.zipf:g}, {self.prefixes} prefixes of ~{self.prefix_tokens:,} tokens, "
            f"{prompts}, {self.load:.0%} load, {ENGINE_TEXT[self.engine]}"
        )


FACTOR_NAMES = ("zipf", "prefixes", "prefix_tokens", "route", "load", "engine")


def level_name(factor: str, value: Any) -> str:
    """A cell's name from the factor it moves and that factor's level."""
    if factor == "zipf":
        return f"Zipf {value:g}"
    if factor == "prefixes":
        return f"{value} prefixes"
    if factor == "prefix_tokens":
        return f"{value // 1024}K-token prefixes"
    if factor == "route":
        return "chats" if value == CHAT else "text prompts"
    if factor == "load":
        return f"load {value:.0%}"
    if factor == "engine":
        return f"engines {value}"
    raise ValueError(f"no factor {factor!r}: one of {', '.join(FACTOR_NAMES)}")


def one_factor_at_a_time(base: Cell, levels: dict[str, Sequence[Any]]) -> tuple[Cell, ...]:
    """The base, then per factor every level but the base's, the rest as the base."""
    cells = [base]
    for factor, values in levels.items():
        for value in values:
            if value == getattr(base, factor):
                continue
            name = level_name(factor, value)
            cells.append(replace(base, name=name, factor=factor, **{factor: value}))
    return tuple(cells)


BASE = Cell("base", "base")
LEVELS: dict[str, Sequence[Any]] = {
    "zipf": (0.6, 1.0, 1.4),
    "prefixes": (10, 100, 300),
    "prefix_tokens": (1024, 4096, 16384),
    "route": (COMPLETION, CHAT),
    "load": (0.5, 0.85, 1.0),
    "engine": (H100, SLOW_4X, SLOW_10X, MIXED),
}


@dataclass(frozen=True)
class SweepPreset:
    name: str
    cells: tuple[Cell, ...]
    seeds: tuple[int, ...]
    sizes: HotPrefix  # what every cell shares: requests, suffixes, answers
    calibration_requests: int
    systems: tuple[RouterSpec, ...] = SYSTEMS
    search: Search = field(default_factory=Search)


def full_preset() -> SweepPreset:
    """13 cells x 3 seeds x 4 systems of 200 requests, and 12 calibrations: about 2.5 h
    on 2 cores (the 10x slower cell alone about 25 min)."""
    return SweepPreset(
        SWEEP,
        one_factor_at_a_time(BASE, LEVELS),
        seeds=(1, 2, 3),
        sizes=HotPrefix(requests=200, answer_tokens=32),
        calibration_requests=120,
        search=Search(max_steps=5),
    )


def quick_preset() -> SweepPreset:
    """About a minute: two cells (H100 speed and mixed engines) of small prefixes, one seed."""
    base = Cell("base", "base", prefixes=20, prefix_tokens=1024)
    return SweepPreset(
        f"{SWEEP}-quick",
        (base, replace(base, name=level_name("engine", MIXED), factor="engine", engine=MIXED)),
        seeds=(1,),
        sizes=HotPrefix(requests=40, suffix_max_tokens=100, answer_tokens=8),
        calibration_requests=30,
        search=Search(max_steps=2, factor=1.6),  # (each step starts a peer router: ~7 s)
    )


def narrowed(
    preset: SweepPreset, seeds: Sequence[int] | None, cells: Sequence[str] | None
) -> SweepPreset:
    """The preset on other seeds, and on these of its cells only (by name, in its order);
    ValueError naming its cells when none is one of them."""
    preset = capacity_narrowed(preset, seeds, None)
    if cells:
        kept = tuple(c for c in preset.cells if c.name in cells)
        unknown = sorted(set(cells) - {c.name for c in preset.cells})
        if unknown or not kept:
            names = ", ".join(repr(c.name) for c in preset.cells)
            raise ValueError(f"--cells {', '.join(map(repr, unknown))}: this sweep has {names}")
        preset = replace(preset, cells=kept)
    return preset


def cluster_spec(cell: Cell, kv: int, features: Features) -> ClusterSpec:
    """The cell's 4 colocated workers (pulls between them and KV events to our router, as
    in `--hot-prefix`), each at its engine's time scale."""
    scales = ENGINES[cell.engine]
    mixed = len(set(scales)) > 1
    slug = "".join(c if c.isalnum() else "-" for c in cell.name.lower())
    return ClusterSpec(
        f"sw-{slug}",
        colocated=INSTANCES,
        label=ENGINE_TEXT[cell.engine],
        time_scale=min(scales),  # what our router's cost model is told: the fastest's
        time_scales=scales if mixed else (),
        max_total_tokens=kv,
        mempool_pull=features.pulls,
        kv_events=features.kv_events,
    )


def make_plan(
    preset: SweepPreset,
    vocab: Vocab,
    encoder: Any,
    features: Features,
    systems: set[str] | None = None,
    on_build: Callable[[], None] = lambda: None,
    known: dict[str, dict[str, Any]] | None = None,
) -> PairedPlan:
    """One config per cell: every seed's workload built to size the KV from its hot set
    (or as `known`, an earlier run's setup, sized it). ValueError when nothing is left to
    run or a request does not fit a worker."""
    specs = tuple(s for s in preset.systems if selected(systems, s.name, None))
    if not specs:
        raise ValueError("nothing to run: no system of the sweep has those names")
    built: dict[HotPrefix, Workload] = {}  # cells that differ in load only build once
    configs, setup = [], {}
    for cell in preset.cells:
        hot: dict[int, int] = {}
        largest = 0
        for seed in preset.seeds:
            builder = cell.builder(preset.sizes, seed)
            if builder not in built:
                built[builder] = builder.build(vocab)
            workload = built[builder]
            hot[seed] = hot_set_tokens(workload, encoder=encoder)
            largest = max(
                largest,
                max(len(planned_prompt_ids(r, encoder)) + r.max_tokens for r in workload.requests),
            )
            on_build()
        earlier = (known or {}).get(cell.name, {}).get("hot_set_tokens")
        hot_set = earlier if isinstance(earlier, int) and earlier > 0 else None
        hot_set = hot_set or int(statistics.median(hot.values()))
        sizing = Sizing(hot_set, 1 / (KV_SHARE * INSTANCES), INSTANCES)
        try:
            sizing.check_fits(largest)
        except ValueError as exc:
            raise ValueError(f"cell {cell.name!r}: {exc}") from exc
        kv = sizing.instance_tokens
        spec = cluster_spec(cell, kv, features)
        labels = {
            "sweep_cell": asdict(cell),
            "shape": spec.label,
            "instance_kv_tokens": kv,
            "hot_set_tokens": hot_set,
        }
        calibration = cell.builder(preset.sizes, CALIBRATION_SEED)
        configs.append(
            Config(
                cell.name,
                "hot_prefix",
                {seed: cell.builder(preset.sizes, seed) for seed in preset.seeds},
                replace(calibration, requests=preset.calibration_requests),
                (Member(spec, specs),),
                ROUND_ROBIN,
                cell.load,
                OPENAI,
                labels,
                rate_key=cell.rate_key,
            )
        )
        setup[cell.name] = {
            "cell": asdict(cell),
            "hot_set_tokens_per_seed": {str(s): v for s, v in hot.items()},
            "hot_set_tokens": hot_set,
            "instance_kv_tokens": kv,
            "largest_request_tokens": largest,
            "time_scales": spec.scales,
            "text": (
                f"{cell.describe()}. Device KV {kv:,} tokens a worker = {KV_SHARE:g} x the "
                f"hot set of {hot_set:,} tokens (prompt pages two or more requests share; "
                f"{'as the run the rates came from sized it; ' if earlier else ''}median of "
                f"seeds {', '.join(f'{s}: {v:,}' for s, v in hot.items())}); worker time "
                f"scales {'/'.join(f'{s:g}' for s in spec.scales)}."
            ),
        }
    return PairedPlan(preset.name, configs, preset.search, features.missing(), setup)


def cell_of(runs: Sequence[Run]) -> Cell | None:
    """The cell its runs were measured in (their `sweep_cell` label)."""
    for run in runs:
        cell = run.get("sweep_cell")
        if isinstance(cell, dict):
            return Cell(**{k: v for k, v in cell.items() if k in Cell.__dataclass_fields__})
    return None


def targets_for(config: str, runs: Sequence[Run]) -> list[Target]:
    """For ours prompt_tree and cost against sglang-router cache_aware (within a seed, the
    median over the seeds): mean and p99 TTFT at most 1.05x in every cell; with hot prefixes
    (Zipf >= 1) at 85 % load and above, p99 at most 0.8x; on the mixed cluster, mean at
    most 0.8x."""
    cell = cell_of(runs)
    ca = CACHE_AWARE.name
    mean, p99 = f"mean TTFT / {ca}'s", f"p99 TTFT / {ca}'s"
    out = []
    for ours in OURS_SYSTEMS:
        mine = ours.name
        out += [
            Target("mean_vs_cache_aware", mean, mine, "ttft_mean_s", "<=", NO_WORSE, ca),
            Target("p99_vs_cache_aware", p99, mine, "ttft_p99_s", "<=", NO_WORSE, ca),
        ]
        if cell is not None and cell.hot:
            about = f"{p99} (hot prefixes at {cell.load:.0%} load)"
            name = "hot_p99_vs_cache_aware"
            out.append(Target(name, about, mine, "ttft_p99_s", "<=", HOT_P99, ca))
        if cell is not None and cell.engine == MIXED:
            about = f"{mean} (mixed engines)"
            name = "mixed_mean_vs_cache_aware"
            out.append(Target(name, about, mine, "ttft_mean_s", "<=", MIXED_MEAN, ca))
    return out
