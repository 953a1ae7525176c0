"""The paired presets on the command line: `--capacity`, `--hot-prefix`, `--pd`, `--sweep`,
`--lora` and `--tenants`, run or reported again.

Kept apart from `__main__` so that the main module only parses and dispatches; a preset's
own module says what it runs (`capacity`, `hot_prefix_preset`, `pd_preset`, `sweep_preset`,
`lora_preset`, `tenants_preset`),
this one how its runs are planned, executed and written: every one through `paired_report`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.multiturn import (
    capacity,
    capacity_report,
    hot_prefix_preset,
    lora_preset,
    pd_preset,
    sweep_preset,
    sweep_report,
    tenants_preset,
)
from benchmarks.multiturn.capacity import Features, narrowed
from benchmarks.multiturn.paired import PairedPlan, known_from, run_paired
from benchmarks.multiturn.paired_report import Kind
from benchmarks.multiturn.runner import Context
from benchmarks.multiturn.trace import DEFAULT_TRACE

Shaped = TypeVar("Shaped", hot_prefix_preset.HotPrefixPreset, pd_preset.PDPreset)


CAPACITY = Kind(
    capacity.CAPACITY,
    Path("benchmarks/results/multiturn_capacity"),
    capacity_report.TITLE,
    "capacity.md",
    capacity_report.targets_for,
    extra=capacity_report.extra,
)
HOT_PREFIX = Kind(
    hot_prefix_preset.HOT_PREFIX,
    Path("benchmarks/results/multiturn_hot_prefix"),
    "Hot shared prefixes (tool-agent-like) at 85% of the sustained rate",
    "hot-prefix.md",
    hot_prefix_preset.targets_for,
)
PD = Kind(
    pd_preset.PD,
    Path("benchmarks/results/multiturn_pd"),
    "PD with several prefills: caching modes against sglang-router and smg PD",
    "pd.md",
    pd_preset.targets_for,
)

SWEEP = Kind(
    sweep_preset.SWEEP,
    Path("benchmarks/results/multiturn_sweep"),
    "Robustness sweep: ours against sglang-router over workloads and engines",
    "sweep.md",
    sweep_preset.targets_for,
    "README.md",
    sweep_report.extra,
)

LORA = Kind(
    lora_preset.LORA,
    Path("benchmarks/results/multiturn_lora"),
    "LoRA adapters of Zipf popularity: 20 adapters on 4 workers holding 4 each",
    "lora.md",
    lora_preset.targets_for,
    extra=lora_preset.extra,
)

TENANTS = Kind(
    tenants_preset.TENANTS,
    Path("benchmarks/results/multiturn_tenants"),
    "Tenants sharing a public tool prompt: what isolation costs, and fairness at saturation",
    "tenants.md",
    tenants_preset.targets_for,
    extra=tenants_preset.extra,
)


def kind_of(preset: str) -> Kind | None:
    """The paired preset a results.json's `preset` names, if any."""
    for kind in (CAPACITY, HOT_PREFIX, PD, SWEEP, LORA, TENANTS):
        if preset in (kind.name, f"{kind.name}-quick"):
            return kind
    return None


def make_plan(
    kind: Kind,
    args: argparse.Namespace,
    vocab: Any,
    encoder: Any,
    on_seed: Callable[[], None],
) -> PairedPlan:
    """The preset with the command line's narrowing; ValueError when it cannot run."""
    features = Features.detect()
    systems = set(args.systems) if args.systems else None
    workloads = set(args.workloads) if args.workloads else None
    rates, known = known_from(args.calibration_from) if args.calibration_from else ({}, None)

    def preset(module: Any, *args_: Any) -> Any:
        return (module.quick_preset if args.quick else module.full_preset)(*args_)

    plan: PairedPlan
    if kind is CAPACITY:
        cap = narrowed(preset(capacity, args.trace or DEFAULT_TRACE), args.seeds, args.multiples)
        plan = capacity.make_plan(cap, vocab, encoder, features, workloads, systems, on_seed)
    elif kind is SWEEP:
        sweep = sweep_preset.narrowed(preset(sweep_preset), args.seeds, args.cells)
        plan = sweep_preset.make_plan(sweep, vocab, encoder, features, systems, on_seed, known)
    elif kind is LORA:
        lora = narrowed(preset(lora_preset), args.seeds, None)
        plan = lora_preset.make_plan(lora, vocab, features, systems, on_seed, known)
    elif kind is TENANTS:
        ten = narrowed(preset(tenants_preset), args.seeds, None)
        plan = tenants_preset.make_plan(ten, vocab, features, systems, on_seed, known)
    elif kind is HOT_PREFIX:
        hot = narrowed(preset(hot_prefix_preset, args.trace), args.seeds, None)
        hot = with_shapes(hot, args.shapes)
        plan = hot_prefix_preset.make_plan(hot, vocab, features, systems, on_seed, known)
    else:
        pd = narrowed(preset(pd_preset, args.trace), args.seeds, args.multiples)
        pd = with_shapes(pd, args.shapes)
        plan = pd_preset.make_plan(pd, vocab, encoder, features, workloads, systems, on_seed, known)
    plan.known = rates
    return plan


def with_shapes(preset: Shaped, shapes: Sequence[str] | None) -> Shaped:
    """The preset on these of its cluster shapes only; ValueError naming the preset's own
    when none of them is one."""
    if not shapes:
        return preset
    kept = tuple(s for s in preset.shapes if s in shapes)
    if not kept:
        raise ValueError(f"--shapes {' '.join(shapes)}: this preset has {list(preset.shapes)}")
    return replace(preset, shapes=kept)


def run(
    kind: Kind,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    session: Context,
) -> dict[str, Any]:
    """Plan (build and size the workloads), measure the sustained rates where the preset
    offers a share of them, run: the figures as results.json holds them."""
    task = session.progress.add_task("plan: build and size workloads", total=None)
    on_seed = lambda: session.progress.advance(task)  # noqa: E731
    try:
        plan = make_plan(kind, args, session.vocab, session.encoder, on_seed)
    except (ValueError, OSError) as exc:
        parser.error(f"--{kind.name}: {exc}")
    searched = any(c.calibration is not None for c in plan.configs)
    notes = [f"Sustained-rate search: {plan.search.describe()}."] if searched else []
    notes += [f"Left out: {m}" for m in plan.notes]
    records, rater = run_paired(session.context(plan.plan()), plan)
    calibration = rater.calibrations
    return dict(
        preset=plan.preset, runs=records, calibration=calibration, setup=plan.setup, notes=notes
    )
