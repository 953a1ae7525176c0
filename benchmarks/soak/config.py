"""The command line: what to start, how much load for how long, and the verdict's threshold."""

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
    window_secs: float | None = None  # None: about 20 windows over the run, 5..60 s each
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
        if self.window_secs is not None:
            return self.window_secs
        return min(60.0, max(5.0, self.duration_s / 20))


def positive(kind: type[float] | type[int], what: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0, else a one-line message naming the flag's unit."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0 ({what}), got {text}")
        return value

    return parse


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def parse_args(argv: Sequence[str] | None, description: str) -> Config:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=description)
    p.add_argument(
        "--minutes",
        type=positive(float, "minutes of load"),
        help=f"default {FULL_MINUTES:g} (--quick: {QUICK_MINUTES:g})",
    )
    p.add_argument("--rps", type=positive(float, "requests per second"), default=FULL_RPS)
    p.add_argument("--quick", action="store_true", help="half a minute of load (the tests')")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default benchmarks/results/soak")
    p.add_argument("--pd", action="store_true", help="one prefill + one decode worker")
    p.add_argument("--workers", type=positive(int, "colocated workers"), default=Config.workers)
    p.add_argument(
        "--max-total-tokens",
        type=positive(int, "tokens of device KV per worker"),
        default=Config.max_total_tokens,
        help="small, so caches evict and churn (default %(default)s)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=Config.time_scale,
        help="the sim's --time-scale (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--sample-secs", type=positive(float, "seconds"), default=Config.sample_secs)
    p.add_argument(
        "--window-secs",
        type=positive(float, "seconds"),
        default=None,
        help="latency window (default: about 20 windows, 5..60 s each)",
    )
    p.add_argument(
        "--warmup-fraction",
        type=fraction,
        default=Config.warmup_fraction,
        help="share of the run before RSS must be flat (default %(default)s)",
    )
    p.add_argument(
        "--slope-threshold",
        type=positive(float, "MiB per minute"),
        default=Config.slope_threshold_mib_per_min,
        help="an RSS slope above this after warm-up is not flat (default %(default)s MiB/min)",
    )
    a = p.parse_args(argv)
    if a.quick and a.minutes is not None:
        p.error("--quick and --minutes: the quick run is half a minute; give one of them")
    if a.time_scale < 0 or not math.isfinite(a.time_scale):
        p.error(f"argument --time-scale: must be >= 0, got {a.time_scale}")
    return Config(
        minutes=a.minutes or (QUICK_MINUTES if a.quick else FULL_MINUTES),
        rps=a.rps,
        out=a.out,
        pd=a.pd,
        workers=int(a.workers),
        max_total_tokens=int(a.max_total_tokens),
        time_scale=a.time_scale,
        seed=a.seed,
        sample_secs=a.sample_secs,
        window_secs=a.window_secs,
        warmup_fraction=a.warmup_fraction,
        slope_threshold_mib_per_min=a.slope_threshold,
    )
