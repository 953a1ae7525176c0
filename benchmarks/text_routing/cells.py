"""One cell: a document sent three times through one route of a fresh router, one request at
a time, the router's /metrics read before and after each."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.load.bodies import COMPLETIONS, GENERATE, body
from benchmarks.load.record import Record
from benchmarks.load.send import send_now
from localrun.cluster import scrape
from localrun.processes import http_ok

ROUTES = (COMPLETIONS, GENERATE)
REQUESTS = 3  # per cell: the same document, three questions
MAX_NEW_TOKENS = 4
SETTLE_TIMEOUT_S = 5.0  # the router has learned from an answer within this
STABLE_S = 0.2  # its counters unchanged this long: nothing more to learn

CACHE_HITS = "sgl_router_cache_hits_total"
PREDICTED = "memserve_router_predicted_cached_tokens_total"
REPORTED = "memserve_router_reported_cached_tokens_total"
PROCESSED = "sgl_router_processed_requests_total"
EVENTS = "sgl_router_load_balancing_events_total"
TOKEN_POLICIES = ("prompt_tree", "cost")  # the policies whose trees learn from answers


def text_probe(url: str) -> Callable[[], bool]:
    """A tiny text request through `url` answers 200 (a tokenizer directory need not have
    a chat template, so the chat probe cannot tell)."""
    probe = body(GENERATE, "ping", MAX_NEW_TOKENS)
    return functools.partial(http_ok, url + GENERATE, probe, timeout=10)


def labelled(counters: dict[str, float], name: str) -> dict[str, float]:
    """{label value: count} of a metric with one label (`name{label="value"}`)."""
    return {k.split('"')[1]: v for k, v in counters.items() if k.startswith(name + "{")}


def grew(before: dict[str, float], after: dict[str, float], name: str) -> list[str]:
    """The label values of `name` whose count grew between the two readings."""
    b = labelled(before, name)
    return [label for label, value in labelled(after, name).items() if value > b.get(label, 0.0)]


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def settled(url: str, before: dict[str, float], learns: bool, cached: int) -> dict[str, float]:
    """The router's counters once it has counted the request and (a token policy) learned
    the cached tokens the worker reported, unchanged for STABLE_S; else, after
    SETTLE_TIMEOUT_S, the last reading."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last: dict[str, float] = {}
    since = time.monotonic()
    while True:
        now = scrape(url + "/metrics")
        if now != last:
            last, since = now, time.monotonic()
        counted = sum(labelled(now, PROCESSED).values()) > sum(labelled(before, PROCESSED).values())
        learned = not learns or delta(before, now, REPORTED) >= cached
        stable = counted and learned and time.monotonic() - since >= STABLE_S
        if stable or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@dataclass
class RequestRecord:
    request: int  # 1, 2, 3
    prompt_tokens: int
    cached_tokens: int  # the worker's report
    predicted_hit: bool  # sgl_router_cache_hits_total grew, or the decision says cache_hit
    cache_hits_delta: float
    reason: str | None  # the routing decision's reason (load-balancing event)
    worker: int | None  # 1 or 2: which worker served it (the router's per-worker count)
    predicted_cached_tokens: float | None  # the trees' prediction (token policies)
    router_reported_cached_tokens: float | None  # what the router learned was reported
    latency_s: float


@dataclass
class Cell:
    document: str
    title: str
    route: str
    document_tokens: int
    shared_tokens: int  # the prompts' common start: at most this much can be cached
    requests: list[RequestRecord] = field(default_factory=list)

    @property
    def predicted_hits(self) -> int:
        return sum(r.predicted_hit for r in self.requests)

    @property
    def target_met(self) -> bool:
        """Issue 37's target: the second and third requests predicted, the first not."""
        hits = [r.predicted_hit for r in self.requests]
        return hits == [False] + [True] * (len(hits) - 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "requests"},
            "predicted_hits": self.predicted_hits,
            "target_met": self.target_met,
            "requests": [asdict(r) for r in self.requests],
        }


def run_cell(
    url: str,
    workers: list[str],
    model: str,
    cell: Cell,
    prompts: Sequence[str],
    learns: bool,
    step: Callable[[], None],
) -> None:
    """Send each prompt through `cell.route` in turn; `learns`: a token policy's tree."""
    for i, prompt in enumerate(prompts):
        before = scrape(url + "/metrics")
        data = body(cell.route, prompt, MAX_NEW_TOKENS, model=model)
        answer = send_now(url, data, Record(path=cell.route))
        after = settled(url, before, learns, answer.cached_tokens)
        served = grew(before, after, PROCESSED)
        reasons = grew(before, after, EVENTS)
        hits = delta(before, after, CACHE_HITS)
        reason = reasons[0] if reasons else None
        cell.requests.append(
            RequestRecord(
                request=i + 1,
                prompt_tokens=answer.prompt_tokens,
                cached_tokens=answer.cached_tokens,
                predicted_hit=hits > 0 or reason == "cache_hit",
                cache_hits_delta=hits,
                reason=reason,
                worker=workers.index(served[0]) + 1 if served and served[0] in workers else None,
                predicted_cached_tokens=delta(before, after, PREDICTED) if learns else None,
                router_reported_cached_tokens=delta(before, after, REPORTED) if learns else None,
                latency_s=round(answer.e2e_s or 0.0, 4),
            )
        )
        step()
