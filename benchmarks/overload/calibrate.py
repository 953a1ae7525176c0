"""The sustained rate, measured on the run's own workers before the ramp.

Short runs of ours (`prompt_tree`, no deadline) at rising offered rates, each rung
`growth` times the last. A rung **holds** while the median answered request meets its TTFT
SLO and its completed prefills per second (first tokens while the load was offered, once
settled: `slo.steady_rps`) grew by at least half as much as the offered rate did over the last rung
that held (a saturated cluster's throughput stops growing: the extra load only queues).
The first rung that does not hold ends the ladder; with `refine`, one more rung halfway
(geometrically) between it and the last that held. The sustained rate is the highest
offered rate that held. The first rung starts at a fraction of the floor's bound,
instances / mean floor TTFT (prefill alone, with the oracle's cache): no cluster can do
better than that bound, so the ladder starts below the knee.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.overload.preset import Calibration


@dataclass(frozen=True)
class Rung:
    rate: float
    first_tokens_rps: float
    slo_share: float | None  # answered requests within their SLO, of those answered
    held: bool = False
    why: str = ""

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def judge(rate: float, throughput: float, slo_share: float | None, last: Rung | None) -> Rung:
    """Whether a rung at `rate` holds, against the last rung that held (None: the first)."""
    if slo_share is None or slo_share < 0.5:
        why = "the median request missed its TTFT SLO"
        return Rung(rate, throughput, slo_share, False, why)
    if last is not None:
        wanted = 1 + (rate / last.rate - 1) / 2
        if throughput < wanted * last.first_tokens_rps:
            why = (
                f"{throughput:.2f} first tokens/s, less than {wanted:.3f}x the "
                f"{last.first_tokens_rps:.2f} at {last.rate:.2f} req/s: throughput stopped growing"
            )
            return Rung(rate, throughput, slo_share, False, why)
    return Rung(rate, throughput, slo_share, True, "")


def sustained_rate(rungs: list[Rung]) -> float | None:
    """The highest offered rate whose rung held."""
    return max((r.rate for r in rungs if r.held), default=None)


def climb(
    start: float, config: Calibration, measure: Callable[[float], tuple[float, float | None]]
) -> list[Rung]:
    """Run the ladder: `measure(rate)` offers `rate` for the rung's duration and returns
    (first tokens per second while offered, share within the SLO). A first rung that misses
    the SLO starts the ladder again lower down (at most twice)."""
    rungs: list[Rung] = []
    last: Rung | None = None
    rate = start
    for _ in range(config.max_rungs):
        rung = judge(rate, *measure(rate), last)
        rungs.append(rung)
        if rung.held:
            last, rate = rung, rate * config.growth
            continue
        if last is None and len(rungs) < 3:
            rate /= config.growth**2
            continue
        break
    failed = rungs[-1]
    if config.refine and last is not None and not failed.held and failed.rate > last.rate:
        middle = math.sqrt(last.rate * failed.rate)
        rungs.append(judge(middle, *measure(middle), last))
    return rungs
