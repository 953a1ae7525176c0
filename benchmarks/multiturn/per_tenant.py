"""Per-tenant figures of a run whose requests name their tenants (`Request.tenant`): TTFT,
hit ratio, and goodput, the computed (uncached) prompt tokens and the requests prefilled
while the load was still being offered; and how the goodput was shared among the tenants
against the shares they were configured with (issue 38's fairness at saturation).

Goodput counts a request whose prefill ended (its first token came) while the load was
still being offered (before the last request was sent) and before the first tenant had all
of its requests prefilled: until then, at saturation, every tenant had requests waiting, so
how the work was shared was the router's choice; past that fewer tenants compete, and over
the whole run every tenant would end with what it sent. Its prompt tokens are computed by
then: counted at the end of its answer instead, the requests in flight when the window ends
(up to the router's concurrency, 8 of 4-6K-token prompts in the fairness cell, about a
fifth of a small tenant's goodput) fell out of it whole, the slowest first, and which
tenant's they were decided the shares as much as the router did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.load.record import Record
from benchmarks.multiturn.metrics import stats
from benchmarks.multiturn.workloads import Request


def per_tenant(
    requests: Sequence[Request], records: Sequence[Record]
) -> dict[str, dict[str, Any]] | None:
    """tenant -> its figures (`records` by rid); None when no request names a tenant."""
    tenants = sorted({r.tenant for r in requests if r.tenant})
    if not tenants:
        return None
    ok = {
        t: [records[r.rid] for r in requests if r.tenant == t and records[r.rid].ok]
        for t in tenants
    }
    ends = [max(map(prefilled, mine)) for mine in ok.values() if mine]
    # the first tenant prefilled in full, or the last request sent
    end = min([*ends, max((o.sent_s or 0.0 for o in records), default=0.0)], default=0.0)
    out: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        mine = ok[tenant]
        prompt = sum(o.prompt_tokens for o in mine)
        cached = sum(o.cached_tokens for o in mine)
        done_in_time = [o for o in mine if prefilled(o) <= end]
        asked = [o for o in mine if (o.sent_s or 0.0) <= end]
        out[tenant] = {
            "requests": sum(r.tenant == tenant for r in requests),
            "ok": len(mine),
            **stats("ttft", [o.ttft_s for o in mine if o.ttft_s is not None]),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_ratio": cached / prompt if prompt else None,
            # its first request's: what it found before it had sent anything (an audit of
            # isolation: none of another tenant's prompt, only a public prefix)
            "first_cached_tokens": first_sent(mine).cached_tokens if mine else None,
            "goodput_requests": len(done_in_time),
            "goodput_computed_tokens": computed(done_in_time),
            # what it asked for by then: the computed tokens of its requests sent in the window
            "demand_computed_tokens": computed(asked),
        }
    return out


def first_sent(records: Sequence[Record]) -> Record:
    """The one of `records` sent first (the lowest rid of those sent at once)."""
    return min(records, key=lambda o: (o.sent_s or 0.0, o.rid))


def computed(records: Sequence[Record]) -> int:
    """The prompt tokens the workers computed for `records` (not cached)."""
    return sum(o.prompt_tokens - o.cached_tokens for o in records)


def prefilled(record: Record) -> float:
    """When an answered request's first token came (its answer's end, where no first token
    was timed), from the start of the run."""
    took = record.ttft_s if record.ttft_s is not None else record.e2e_s
    return (record.sent_s or 0.0) + (took or 0.0)


def fairness(
    tenants: Mapping[str, Mapping[str, Any]], shares: Mapping[str, float]
) -> dict[str, Any]:
    """Each tenant's share of the goodput (computed tokens, and requests) against its
    configured share (`shares`: relative weights), and the worst deviation of the token
    share from the configured one (|goodput share / configured share - 1|); beside them,
    the weighted max-min fair shares of the goodput given what each tenant asked for
    (`max_min_shares`, from `max_min_fair`) and the worst deviation from those."""
    weight = sum(shares.values())
    configured = {t: w / weight for t, w in shares.items()}
    tokens = {t: float(tenants.get(t, {}).get("goodput_computed_tokens") or 0) for t in shares}
    done = {t: float(tenants.get(t, {}).get("goodput_requests") or 0) for t in shares}
    total_tokens, total_done = sum(tokens.values()), sum(done.values())
    token_share = {t: v / total_tokens if total_tokens else None for t, v in tokens.items()}
    request_share = {t: v / total_done if total_done else None for t, v in done.items()}
    deviations = [abs(s / configured[t] - 1) for t, s in token_share.items() if s is not None]
    demand = {t: float(tenants.get(t, {}).get("demand_computed_tokens") or 0) for t in shares}
    fair = max_min_fair(total_tokens, demand, shares)
    fair_share = {t: v / total_tokens if total_tokens else None for t, v in fair.items()}
    off_fair = [abs(tokens[t] / v - 1) for t, v in fair.items() if v > 0]
    return {
        "configured_shares": configured,
        "goodput_token_shares": token_share,
        "goodput_request_shares": request_share,
        "share_deviation": max(deviations) if deviations else None,
        "max_min_shares": fair_share,
        "max_min_deviation": max(off_fair) if off_fair else None,
    }


def max_min_fair(
    capacity: float, demand: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity`: a tenant that asked for less than its
    weight's part gets what it asked for, the rest is split by weight among the others (a
    tenant whose prompts stay cached, and so cost little, may need less than its share;
    what it leaves is the others' to take, not unfairness)."""
    out: dict[str, float] = {}
    left, weight = capacity, sum(weights[t] for t in demand)
    for tenant in sorted(demand, key=lambda t: demand[t] / weights[t]):
        part = left * weights[tenant] / weight if weight > 0 else 0.0
        out[tenant] = min(demand[tenant], part)
        left -= out[tenant]
        weight -= weights[tenant]
    return out
