"""What counts as good, and how long a request waited: one run's figures from its requests.

- A request's **floor** is its TTFT alone on an instance with the oracle's cache (module
  `benchmarks.multiturn.floor`): what no router can beat. Its **TTFT SLO** is its floor
  plus the deadline D: it may wait D before its own prefill, whatever its length.
- Its **wait** is its TTFT minus its own modelled prefill with the prefix its worker really
  had cached (the answer's `cached_tokens`): everything that was not its own computation,
  i.e. the router's queue, the worker's queue and the steps its prefill shared with other
  requests. A request refused with 429 never waited (it is not admitted).
- **Goodput** is the requests answered within their SLO per second of the run's span (its
  first send to its last answer's end); **throughput** counts every answered request.

Statuses: `ok` (answered), `refused` (429: not admitted), `error` (anything else).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import percentile

OK = "ok"
REFUSED = "refused"
ERROR = "error"


@dataclass(frozen=True)
class Sample:
    """One request, reduced to what the figures need (times in seconds from the run's start)."""

    status: str  # OK | REFUSED | ERROR
    sent_s: float | None
    ttft_s: float | None = None
    end_s: float | None = None  # the answer's end
    floor_s: float = 0.0  # alone, with the oracle's cache: the SLO's base
    own_prefill_s: float | None = None  # alone, with what its worker had cached
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def wait_s(self) -> float | None:
        """TTFT minus its own prefill (None unless answered)."""
        if self.status != OK or self.ttft_s is None or self.own_prefill_s is None:
            return None
        return self.ttft_s - self.own_prefill_s

    def good(self, deadline_s: float) -> bool:
        """Answered within its TTFT SLO: its floor plus the deadline."""
        return (
            self.status == OK
            and self.ttft_s is not None
            and self.ttft_s <= slo_s(self.floor_s, deadline_s)
        )


def slo_s(floor_s: float, deadline_s: float) -> float:
    return floor_s + deadline_s


def status_of(outcome: str) -> str:
    """A request's outcome (`benchmarks.load.record`) as a status: `http_429` is a refusal."""
    if outcome == "ok":
        return OK
    return REFUSED if outcome == "http_429" else ERROR


def span_s(samples: Sequence[Sample]) -> float | None:
    """From the first send to the last answer's end (None when nothing was answered)."""
    sent = [s.sent_s for s in samples if s.sent_s is not None]
    ends = [s.end_s for s in samples if s.end_s is not None]
    if not sent or not ends:
        return None
    return max(ends) - min(sent)


def steady_rps(samples: Sequence[Sample], skip: float = 0.25) -> float | None:
    """First tokens per second while the load was offered, once it had settled: requests
    whose first token came between `skip` of the send window and the last send, over that
    time. The rate prefills complete at, which is what a TTFT SLO is about: answers finish
    much later than their first token when every engine step also carries a long prefill
    (a decode token a step), so counting answers would lag the load. Neither the start
    (nothing is done yet) nor the drain after the last send weighs in, so it stops growing
    where the cluster saturates, however short the run."""
    sent = [s.sent_s for s in samples if s.sent_s is not None]
    if len(sent) < 2:
        return None
    start = min(sent) + skip * (max(sent) - min(sent))
    end = max(sent)
    if end <= start:
        return None
    firsts = [s.sent_s + s.ttft_s for s in samples if s.sent_s is not None and s.ttft_s is not None]
    return sum(1 for t in firsts if start <= t <= end) / (end - start)


def figures(samples: Sequence[Sample], deadline_s: float) -> dict[str, Any]:
    """One run's figures: counts, goodput and throughput, TTFT and wait of the answered."""
    answered = [s for s in samples if s.status == OK and s.ttft_s is not None]
    refused = sum(s.status == REFUSED for s in samples)
    errors = sum(s.status == ERROR for s in samples) + sum(
        s.status == OK and s.ttft_s is None for s in samples
    )
    good = sum(s.good(deadline_s) for s in samples)
    span = span_s(samples)
    ttfts = [s.ttft_s for s in answered if s.ttft_s is not None]
    waits = [w for s in answered if (w := s.wait_s) is not None]
    prompt = sum(s.prompt_tokens for s in answered)
    sent = sorted(s.sent_s for s in samples if s.sent_s is not None)
    return {
        "requests": len(samples),
        "admitted": len(samples) - refused,
        "refused": refused,
        "errors": errors,
        "completed": len(answered),
        "good": good,
        "span_s": span,
        "sent_rps": (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 2 else None,
        "goodput_rps": good / span if span else 0.0,
        "throughput_rps": len(answered) / span if span else 0.0,
        "steady_rps": steady_rps(samples),
        "slo_share": good / len(answered) if answered else None,
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "ttft_max_s": max(ttfts, default=None),
        "wait_p50_s": percentile(waits, 0.5) if waits else None,
        "wait_p99_s": percentile(waits, 0.99) if waits else None,
        "wait_max_s": max(waits, default=None),
        "over_deadline": sum(w > deadline_s for w in waits),
        "hit_ratio": sum(s.cached_tokens for s in answered) / prompt if prompt else None,
        "computed_tokens": prompt - sum(s.cached_tokens for s in answered),
        "floor_mean_s": statistics.fmean(s.floor_s for s in samples) if samples else None,
    }


def longest_waits(samples: Sequence[Sample], n: int = 5) -> list[dict[str, Any]]:
    """The `n` admitted requests that waited longest: what a missed wait target is made of."""
    timed = sorted((s for s in samples if s.wait_s is not None), key=lambda s: -(s.wait_s or 0.0))
    return [
        {
            "wait_s": s.wait_s,
            "ttft_s": s.ttft_s,
            "own_prefill_s": s.own_prefill_s,
            "sent_s": s.sent_s,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
        }
        for s in timed[:n]
    ]
