"""The issue's targets from the runs: reported with value, limit and met, never asserted.

- **goodput holds**: past saturation (every step above 100%), ours with the deadline keeps
  at least 90% of its peak goodput (the medians over seeds; per seed, each against its own
  peak, for the spread);
- **no wait past the deadline**: no request ours with the deadline admitted waited longer
  than D (module `slo`'s wait), at any step and seed;
- **against cache_aware**: ours' goodput over sglang-router cache_aware's at each step,
  paired per seed (the same requests), reported without a limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import finite
from benchmarks.overload.preset import CACHE_AWARE, PAST_SATURATION, WITH_DEADLINE
from benchmarks.report import seeds as over_seeds
from benchmarks.report.seeds import Run, ratio
from benchmarks.report.targets import check

GOODPUT_KEPT = 0.9  # past saturation, goodput >= this x its peak


def by_step(runs: Sequence[Run], system: str) -> dict[float, dict[int, Run]]:
    """fraction -> seed -> the run of `system`."""
    out: dict[float, dict[int, Run]] = {}
    for run in runs:
        if run["system"] == system:
            out.setdefault(run["fraction"], {})[run["seed"]] = run
    return dict(sorted(out.items()))


def median_of(runs: dict[int, Run], key: str) -> float | None:
    return over_seeds.median_of(r.get(key) for r in runs.values())


def goodput_kept(steps: dict[float, dict[int, Run]]) -> dict[str, Any]:
    """The lowest goodput past saturation as a share of the peak (medians over seeds)."""
    medians = {f: median_of(seeds, "goodput_rps") for f, seeds in steps.items()}
    known = {f: g for f, g in medians.items() if g is not None}
    past = [f for f in known if f > PAST_SATURATION]
    about = "ours with the deadline: lowest goodput past saturation / its peak"
    if not known or not past:
        return check(None, ">=", GOODPUT_KEPT, about)
    peak_at = max(known, key=lambda f: known[f])
    worst = min(past, key=lambda f: known[f])
    t = check(ratio(known[worst], known[peak_at]), ">=", GOODPUT_KEPT, about)
    per_seed = []
    for seed in {s for seeds in steps.values() for s in seeds}:
        mine = {f: seeds[seed]["goodput_rps"] for f, seeds in steps.items() if seed in seeds}
        top = max(mine.values(), default=0.0)
        lows = [mine[f] for f in mine if f > PAST_SATURATION]
        if top > 0 and lows:
            per_seed.append(min(lows) / top)
    if (s := over_seeds.spread(per_seed)) is not None:
        t["spread"] = (s["min"], s["max"])
    t["detail"] = (
        "; ".join(f"{f:.0%}: {g:.2f} req/s" for f, g in known.items())
        + f" (peak at {peak_at:.0%}, lowest past saturation at {worst:.0%})"
    )
    if t["met"] is False:
        t["why"] = goodput_why(steps[worst], known[worst], known[peak_at])
    return t


def goodput_why(seeds: dict[int, Run], goodput: float, peak: float) -> str:
    """What the step whose goodput fell shows: refusals, throughput, SLO misses, waits."""
    admitted = median_of(seeds, "admitted")
    refused = median_of(seeds, "refused")
    throughput = median_of(seeds, "throughput_rps")
    share = median_of(seeds, "slo_share")
    wait = median_of(seeds, "wait_p99_s")
    return (
        f"goodput {goodput:.2f} vs peak {peak:.2f} req/s; median over seeds: admitted "
        f"{admitted:.0f}, refused {refused:.0f}, throughput {throughput:.2f} req/s, "
        f"{share:.0%} of the answered within their SLO, wait p99 {wait:.2f} s"
        if None not in (admitted, refused, throughput, share, wait)
        else f"goodput {goodput:.2f} vs peak {peak:.2f} req/s"
    )


@dataclass(frozen=True)
class Workers:
    """What the wait target's explanation needs to know of the workers as they ran."""

    prefill_s_per_token: float  # wall seconds (the sim's figure x its time scale)
    chunk_tokens: int  # --chunked-prefill-size: the prompt tokens one step computes

    @property
    def step_s(self) -> float:
        """A step full of prefill: what a first token may wait for besides its queue."""
        return self.chunk_tokens * self.prefill_s_per_token

    def priced(self, run: Run) -> float | None:
        """The share of the workers' busy time that the queue term's price per prompt
        token accounts for."""
        return ratio(
            (run.get("computed_tokens") or 0) * self.prefill_s_per_token, run.get("busy_s")
        )


def wait_within(
    steps: dict[float, dict[int, Run]], deadline_s: float, workers: Workers
) -> dict[str, Any]:
    """The longest wait of an admitted request, over every step and seed, against D."""
    runs = [r for seeds in steps.values() for r in seeds.values()]
    waits = [r["wait_max_s"] for r in runs if finite(r.get("wait_max_s"))]
    about = "ours with the deadline: longest wait of an admitted request / the deadline"
    t = check(ratio(max(waits), deadline_s) if waits else None, "<=", 1.0, about)
    over = sum(r.get("over_deadline") or 0 for r in runs)
    answered = sum(r.get("completed") or 0 for r in runs)
    t["detail"] = (
        f"longest {max(waits, default=float('nan')):.2f} s vs D {deadline_s:.2f} s; "
        f"{over} of {answered} answered requests waited longer than D"
    )
    if t["met"] is False:
        worst = max(runs, key=lambda r: r.get("wait_max_s") or 0.0)
        top = (worst.get("longest_waits") or [{}])[0]
        priced = workers.priced(worst)
        t["why"] = (
            f"worst at {worst['fraction']:.0%}, seed {worst['seed']}: waited "
            f"{top.get('wait_s', 0):.2f} s (TTFT {top.get('ttft_s', 0):.2f} s, own prefill "
            f"{top.get('own_prefill_s', 0):.2f} s, {top.get('prompt_tokens', 0)} prompt tokens, "
            f"{top.get('cached_tokens', 0)} cached); that run: wait p99 "
            f"{worst.get('wait_p99_s') or 0:.2f} s, {worst.get('over_deadline')} over D. The "
            "admission bounds the expected wait before a prefill starts; a first token also "
            "waits for the rest of its step, which computes other prompts too (up to "
            f"{workers.chunk_tokens} tokens, {workers.step_s:.2f} s), and the queue term, "
            "priced per prompt token, covered "
            + (f"{priced:.0%}" if priced is not None else "?")
            + " of the workers' busy time in that run (attention pairs, the decode tokens "
            "every step carries and step overheads are not in it)"
        )
    return t


def paired_ratios(
    runs: Sequence[Run], system: str, peer: str = CACHE_AWARE, key: str = "goodput_rps"
) -> dict[float, dict[str, Any] | None]:
    """fraction -> median and min..max over seeds of `system`'s `key` / `peer`'s."""
    mine, theirs = by_step(runs, system), by_step(runs, peer)
    out: dict[float, dict[str, Any] | None] = {}
    for fraction, runs_at in mine.items():
        per_seed = over_seeds.paired(
            runs_at, theirs.get(fraction, {}), lambda a, b: ratio(a.get(key), b.get(key))
        )
        out[fraction] = over_seeds.spread(per_seed.values())
    return out


def all_targets(runs: Sequence[Run], deadline_s: float, workers: Workers) -> dict[str, Any]:
    """The two targets with limits; the ratios to cache_aware are `paired_ratios`."""
    steps = by_step(runs, WITH_DEADLINE)
    return {
        "goodput_past_saturation": goodput_kept(steps),
        "wait_within_deadline": wait_within(steps, deadline_s, workers),
    }
