"""One run's figures from its outcomes: latency statistics, hit ratios, per-turn TTFT."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import percentile
from benchmarks.load.record import Record

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# The share of the sending counted as the warm-up: every cache is cold then, and a rate
# sized for warm caches overloads every router alike (`ttft_warm_*`: the requests after it).
WARM_UP = 0.25


def stats(prefix: str, samples: Sequence[float]) -> dict[str, float | None]:
    """`{prefix}_mean_s`, `_p50_s`, `_p90_s`, `_p99_s` (None without samples)."""
    out: dict[str, float | None] = {
        f"{prefix}_mean_s": statistics.fmean(samples) if samples else None
    }
    for name, q in QUANTILES.items():
        out[f"{prefix}_{name}_s"] = percentile(samples, q) if samples else None
    return out


def summarize(
    outcomes: Sequence[Record],
    oracle: Sequence[int | None],
    oracle_lengths: Sequence[int | None],
    wall_s: float,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    jct = [o.e2e_s for o in ok if o.e2e_s is not None]
    tpot = [t for o in ok if (t := o.tpot_s) is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    completion = sum(o.completion_tokens for o in ok)
    # The oracle over the same (successful) requests, so both ratios share a denominator.
    oracle_cached = sum(oracle[o.rid] or 0 for o in ok)
    oracle_prompt = sum(oracle_lengths[o.rid] or 0 for o in ok)
    sent = [o.sent_s for o in outcomes if o.sent_s is not None]
    sends = (min(sent), max(sent)) if sent else None  # the run's first and last send
    span = active_span(outcomes, wall_s)
    per_turn: dict[int, list[float]] = {}
    for o in ok:
        if o.ttft_s is not None:
            per_turn.setdefault(o.turn, []).append(o.ttft_s)
    out: dict[str, Any] = {
        **split(ok),
        "requests": len(outcomes),
        "completed": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_samples": sorted({p for o in outcomes if (p := o.problem)})[:5],
        # tries refused with 429 and sent again (TTFT and JCT count from the first try)
        "retries_429": sum(o.retries_429 for o in outcomes),
        **stats("ttft", ttft),
        **stats("tpot", tpot),
        **stats("jct", jct),
        "duration_s": span,
        "throughput_rps": len(ok) / span if span > 0 else None,
        "output_tokens_per_s": completion / span if span > 0 else None,
        "offered_rps": len(sent) / (max(sent) - min(sent)) if len(sent) > 1 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "hit_ratio": cached / prompt if prompt else None,
        "oracle_hit_ratio": oracle_cached / oracle_prompt if oracle_prompt else None,
        "oracle_prompt_tokens": oracle_prompt,
        "per_turn_ttft_mean_s": {str(t): statistics.fmean(v) for t, v in sorted(per_turn.items())},
        "per_turn_requests": {str(t): len(v) for t, v in sorted(per_turn.items())},
        "ttft_tail": tail(ok, sends),
        **warm(ok, sends),
    }
    return out


def warm(ok: Sequence[Record], sends: tuple[float, float] | None) -> dict[str, float | None]:
    """TTFT mean and p99 of the requests sent after the first WARM_UP of the sending (from
    the run's first to its last send): the steady state, without the cold start."""
    first, last = sends or (0.0, 0.0)
    start = first + WARM_UP * (last - first)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None and (o.sent_s or 0.0) >= start]
    return {
        "ttft_warm_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_warm_p99_s": percentile(ttft, QUANTILES["p99"]) if ttft else None,
    }


def split(ok: Sequence[Record]) -> dict[str, Any]:
    """Where the prompt tokens of answered requests came from: this instance's device tier,
    its host tier, a peer (pulled), or recomputed; and of the device and host ones, those on
    pages a decode wrote back (`written_back`, PD-Caching-3; shared only where the workers
    report it). A reused token counts wherever it came from (`reuse_ratio`); an answer that
    does not say its tiers counts its cached tokens as device ones, and `split_reported`
    says how many did."""
    prompt = sum(o.prompt_tokens for o in ok)
    device = sum(o.cached_tokens if o.device_tokens is None else o.device_tokens for o in ok)
    host = sum(o.host_tokens or 0 for o in ok)
    pulled = sum(o.pulled_tokens or 0 for o in ok)
    written_back = sum(o.written_back_tokens or 0 for o in ok)
    recomputed = prompt - device - host - pulled
    out: dict[str, Any] = {
        "device_tokens": device,
        "host_tokens": host,
        "pulled_tokens": pulled,
        "written_back_tokens": written_back,
        "recomputed_tokens": recomputed,
        "split_reported": sum(1 for o in ok if o.device_tokens is not None),
        "pulls_reported": sum(1 for o in ok if o.pulled_tokens is not None),
        "reuse_ratio": (device + host + pulled) / prompt if prompt else None,
    }
    shares = [("device", device), ("host", host), ("pulled", pulled)]
    if any(o.written_back_tokens is not None for o in ok):  # workers that report it
        shares.append(("written_back", written_back))
    for name, value in shares:
        out[f"{name}_share"] = value / prompt if prompt else None
    out["recomputed_share"] = recomputed / prompt if prompt else None
    return out


def active_span(outcomes: Sequence[Record], wall_s: float) -> float:
    """From the first send to the last answer's end (`wall_s` if nothing was answered)."""
    sent = [o.sent_s for o in outcomes if o.sent_s is not None]
    ends = [o.sent_s + o.e2e_s for o in outcomes if o.sent_s is not None and o.e2e_s is not None]
    return (max(ends) - min(sent)) if ends and sent else wall_s


def tail(
    ok: Sequence[Record], sends: tuple[float, float] | None = None, fraction: float = 0.05
) -> list[dict[str, Any]]:
    """The slowest `fraction` of requests by TTFT (at least 2): what the p99 is made of;
    with the run's first and last send (`sends`), when each was sent between them (0..1:
    a tail sent at the start is a cold start's)."""
    timed = sorted((o for o in ok if o.ttft_s is not None), key=lambda o: -(o.ttft_s or 0))
    n = max(2, math.ceil(len(timed) * fraction))
    first, last = sends or (0.0, 0.0)
    return [
        {
            "rid": o.rid,
            "turn": o.turn,
            "ttft_s": o.ttft_s,
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "host_tokens": o.host_tokens or 0,
            "pulled_tokens": o.pulled_tokens or 0,
            "sent_at": (
                (o.sent_s - first) / (last - first)
                if o.sent_s is not None and last > first
                else None
            ),
        }
        for o in timed[:n]
    ]
