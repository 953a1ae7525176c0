"""The ramp's sizes per preset, and the systems it compares.

The sim runs `time_scale` times slower than the modelled H100 so that two CPU cores (the
client, one router and four workers) can offer 150% of what the workers sustain: at 4x a
worker serves a few trace requests a second, and the CPU stays below saturation at the top
step. Every size is here; nothing in the other modules is a preset's number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.multiturn.cluster import RouterSpec
from benchmarks.peers import OURS, SGLANG_ROUTER

FULL = "full"
QUICK = "quick"
INSTANCES = 4
STEP_FRACTIONS = (0.5, 0.75, 1.0, 1.25, 1.5)
PAST_SATURATION = 1.0  # steps above this fraction are "past saturation" for the targets


@dataclass(frozen=True)
class Calibration:
    """A ladder of short runs of ours without a deadline, from `start_fraction` of the
    floor's bound (instances / mean floor TTFT) up by `growth` a rung, then one rung
    between the last that held and the first that did not."""

    duration_s: float
    start_fraction: float = 0.4
    growth: float = 1.25
    max_rungs: int = 8
    refine: bool = True


@dataclass(frozen=True)
class Preset:
    name: str
    time_scale: float
    sessions: int  # whole trace sessions sampled per seed (the request pool)
    max_input_tokens: int
    max_output_tokens: int
    step_duration_s: float  # offered load per step (requests = rate x this)
    calibration: Calibration
    seeds: tuple[int, ...]
    fractions: tuple[float, ...] = STEP_FRACTIONS
    deadline_multiple: float = 4.0  # D = this x the pool's mean floor TTFT
    queue_size: int = 0  # ours with the deadline: --queue-size (0: refuse, never hold)


def full_preset() -> Preset:
    """About 35 minutes on 2 cores: 3 seeds x 5 steps x 3 systems of 30 s each."""
    return Preset(
        FULL,
        time_scale=4.0,
        sessions=600,
        max_input_tokens=16384,
        max_output_tokens=64,
        step_duration_s=30.0,
        calibration=Calibration(duration_s=20.0),
        seeds=(1, 2, 3),
    )


def quick_preset() -> Preset:
    """About a minute and a half: one seed, three steps of a few seconds, the top one at
    three times the sustained rate so that queues form even in 4 s (later turns wait for
    their previous answers, which thins the load of a short step)."""
    return Preset(
        QUICK,
        time_scale=4.0,
        sessions=200,
        max_input_tokens=8192,
        max_output_tokens=16,
        step_duration_s=4.0,
        calibration=Calibration(duration_s=4.0, max_rungs=4, refine=False),
        seeds=(1,),
        fractions=(0.5, 1.0, 3.0),
    )


def preset_for(
    quick: bool, seeds: tuple[int, ...] = (), fractions: tuple[float, ...] = ()
) -> Preset:
    preset = quick_preset() if quick else full_preset()
    if seeds:
        preset = replace(preset, seeds=tuple(dict.fromkeys(seeds)))
    if fractions:
        preset = replace(preset, fractions=tuple(sorted(set(fractions))))
    return preset


# --------------------------------------------------------------------------- systems

WITH_DEADLINE = "ours prompt_tree + deadline"
WITHOUT_DEADLINE = "ours prompt_tree"
CACHE_AWARE = "sglang-router cache_aware"


def systems(deadline_s: float, queue_size: int) -> tuple[RouterSpec, ...]:
    """Ours with admission by expected wait (deadline D), ours without, sglang-router's
    cache_aware with its defaults (it has no expected-wait admission). Both of ours get the
    cost model scaled to the workers' time scale from the cluster (`scaled_cost_args`)."""
    admission = ("--max-expected-wait-secs", f"{deadline_s:.3f}", "--queue-size", str(queue_size))
    return (
        RouterSpec(OURS, "prompt_tree", args=admission, tag="+ deadline"),
        RouterSpec(OURS, "prompt_tree"),
        RouterSpec(SGLANG_ROUTER, "cache_aware"),
    )
