"""The command line: how much load for how long, and the verdict's threshold. The cluster's
sizes (3 sim workers of 2,048 tokens of device KV at time scale 0.5) are `Config`'s."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "soak"
# The committed run's load, and the quick one the tests run.
FULL_MINUTES, FULL_RPS, QUICK_MINUTES = 10.0, 4.0, 0.5


@dataclass(frozen=True)
class Config:
    minutes: float
    rps: float
    out: Path
    pd: bool = False
    workers: int = 3  # colocated workers (PD: one prefill + one decode instead)
    max_total_tokens: int = 2048  # device KV per worker: small, so caches evict all the time
    time_scale: float = 0.5  # the sim's modelled GPU time x this is slept
    seed: int = 0
    sample_secs: float = 2.0
    warmup_fraction: float = 0.5  # RSS slope fitted on what follows (the second half)
    slope_threshold_mib_per_min: float = 1.0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_s(self) -> float:
        return self.duration_s * self.warmup_fraction

    @property
    def window_s(self) -> float:
        """About 20 latency windows over the run, 5..60 s each."""
        return min(60.0, max(5.0, self.duration_s / 20))


def number(what: str, ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: a float for which `ok` holds, else one line naming the flag's unit."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule} ({what}), got {text}")
        return value

    return parse


def positive(what: str) -> Callable[[str], float]:
    return number(what, lambda v: v > 0, "> 0")


def parse_args(argv: Sequence[str] | None, description: str) -> Config:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=description)
    p.add_argument(
        "--minutes",
        type=positive("minutes of load"),
        help=f"default {FULL_MINUTES:g} (--quick: {QUICK_MINUTES:g})",
    )
    p.add_argument("--rps", type=positive("requests per second"))
    p.add_argument("--quick", action="store_true", help="half a minute of load (the tests')")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default benchmarks/results/soak")
    p.add_argument("--pd", action="store_true", help="one prefill + one decode worker")
    p.add_argument(
        "--warmup-fraction",
        type=number("a number in [0, 1)", lambda v: 0 <= v < 1, "in [0, 1)"),
        default=Config.warmup_fraction,
        help="share of the run before RSS must be flat (default %(default)s)",
    )
    p.add_argument(
        "--slope-threshold",
        type=positive("MiB per minute"),
        default=Config.slope_threshold_mib_per_min,
        help="an RSS slope above this after warm-up is not flat (default %(default)s MiB/min)",
    )
    a = p.parse_args(argv)
    if a.quick and a.minutes is not None:
        p.error("--quick and --minutes: the quick run is half a minute; give one of them")
    return Config(
        minutes=a.minutes or (QUICK_MINUTES if a.quick else FULL_MINUTES),
        rps=a.rps or FULL_RPS,
        out=a.out,
        pd=a.pd,
        warmup_fraction=a.warmup_fraction,
        slope_threshold_mib_per_min=a.slope_threshold,
    )
