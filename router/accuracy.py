"""The router watches its own accuracy: cached tokens it predicted against what workers reported.

Prefix routing only works while the prompt trees hold what the engines cache. When they stop
doing so (the router tokenizes text differently from the engines: another tokenizer or chat
template; the trees expire entries faster than the engines evict; clients reach the workers
around the router) nothing fails: workers keep reporting cached tokens the router never
predicted, requests are placed by load alone and hit ratios fall quietly. This module makes
that visible.

Every answer whose worker reported `cached_tokens` adds to three totals per worker (exported
as counters by router.metrics): the tokens predicted, the tokens reported, and the tokens
foreseen, min(predicted, reported): the reported hits the router saw coming. Over a sliding
window (60 s by default, kept in tenths) foreseen / reported is the prediction accuracy (a
gauge); when workers reported at least `min_reported` tokens in a window and the router
foresaw under `min_ratio` of them, one warning says prefix routing has lost its view (at most
one per window, never one per request).

With several processes (`--processes N`) each process watches the answers it relayed: its
window is a share of the router's traffic, its gauge is its own, and each may warn on its
own. The counters add up over processes (router.metrics).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW_S = 60.0
MIN_RATIO = 0.1
# Cached tokens reported in a window before the ratio means anything: a few requests' worth of
# reused prefix (a chat's system prompt and history is commonly 500-2,000 tokens), so one or
# two unforeseen hits (a client that went to a worker directly, the first turns after a
# restart of the router while the workers kept their caches) do not warn, while a blind router
# under any real multi-turn load crosses it within the window. Four pages (64 tokens) would be
# a single short request.
MIN_REPORTED = 4096
SLICES = 10  # the window is kept in this many slices: the watch's time resolution
MOST_AFFECTED = 3  # workers named in the warning
ALL = "all"  # the gauge's label for every worker together


@dataclass(slots=True)
class Tally:
    """Cached tokens predicted, reported, and foreseen (min of the two, summed per answer)."""

    predicted: int = 0
    reported: int = 0
    foreseen: int = 0

    def add(self, predicted: int, reported: int, foreseen: int) -> None:
        self.predicted += predicted
        self.reported += reported
        self.foreseen += foreseen

    def merge(self, other: Tally) -> None:
        self.add(other.predicted, other.reported, other.foreseen)

    @property
    def accuracy(self) -> float:
        """Foreseen over reported; NaN when nothing was reported."""
        return self.foreseen / self.reported if self.reported else math.nan


class AccuracyWatch:
    """Per-worker prediction totals, and the blindness watch over a sliding window."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_ratio: float = MIN_RATIO,
        min_reported: int = MIN_REPORTED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0:
            raise ValueError("the accuracy window must be positive")
        self.window_s = window_s
        self.min_ratio = min_ratio
        self.min_reported = min_reported
        self.clock = clock
        self.totals: dict[str, Tally] = {}  # worker URL -> since the router started
        self.warnings = 0
        self._slice_s = window_s / SLICES
        # (start, worker URL -> tally) per slice, oldest first; the last one is filling
        self._slices: deque[tuple[float, dict[str, Tally]]] = deque()
        self._slice_end = -math.inf
        self._started: float | None = None  # when the first answer was observed
        self._warned_at = -math.inf

    def observe(self, url: str, predicted: int, reported: int) -> None:
        """`url` reported `reported` cached tokens where the trees predicted `predicted`."""
        foreseen = min(predicted, reported)
        total = self.totals.get(url)
        if total is None:
            total = self.totals[url] = Tally()
        total.add(predicted, reported, foreseen)
        now = self.clock()
        if now >= self._slice_end:
            self._next_slice(now)
        tallies = self._slices[-1][1]
        tally = tallies.get(url)
        if tally is None:
            tally = tallies[url] = Tally()
        tally.add(predicted, reported, foreseen)

    def window(self, now: float | None = None) -> dict[str, Tally]:
        """Per worker, what the last window holds (slices overlapping it: `window_s` to a
        tenth more)."""
        now = self.clock() if now is None else now
        since = now - self.window_s - self._slice_s
        out: dict[str, Tally] = {}
        for start, tallies in self._slices:
            if start <= since:
                continue
            for url, tally in tallies.items():
                out.setdefault(url, Tally()).merge(tally)
        return out

    def accuracy(self, now: float | None = None) -> dict[str, float]:
        """Foreseen over reported in the last window, per worker and for all of them
        (`ALL`); a worker that reported nothing there is left out, and so is `ALL`."""
        per_worker = self.window(now)
        out = {url: t.accuracy for url, t in per_worker.items() if t.reported}
        overall = _sum(per_worker.values())
        if overall.reported:
            out[ALL] = overall.accuracy
        return out

    def _next_slice(self, now: float) -> None:
        """A new slice begins: check the window up to now (once the watch has seen a whole
        window of answers: the first seconds alone say little), drop what left it."""
        if self._started is None:
            self._started = now
        elif now - self._started >= self.window_s:
            self._check(now)
        since = now - self.window_s - self._slice_s
        while self._slices and self._slices[0][0] <= since:
            self._slices.popleft()
        start = now - now % self._slice_s
        self._slices.append((start, {}))
        self._slice_end = start + self._slice_s

    def _check(self, now: float) -> None:
        """Warn, at most once a window, when the router foresaw under `min_ratio` of a
        sizeable amount of reported cached tokens."""
        if now - self._warned_at < self.window_s:
            return
        per_worker = self.window(now)
        overall = _sum(per_worker.values())
        if overall.reported < self.min_reported:
            return
        if overall.foreseen >= self.min_ratio * overall.reported:
            return
        self._warned_at = now
        self.warnings += 1
        missed = sorted(per_worker.items(), key=lambda kv: kv[1].foreseen - kv[1].reported)
        named = ", ".join(
            f"{url} ({t.accuracy:.0%} of {t.reported:,})"
            for url, t in missed[:MOST_AFFECTED]
            if t.reported
        )
        log.warning(
            "prefix routing has lost its view of the workers' caches: over the last %.0f s the "
            "router foresaw %.1f%% of the %s cached tokens workers reported (under %.0f%%); "
            "most affected: %s. The prompt trees do not hold what the engines cache: the "
            "router may tokenize text differently from the engines (another tokenizer or chat "
            "template than the model's), its trees may expire too fast (--tree-ttl-secs), or "
            "clients may reach the workers around the router",
            self.window_s,
            100 * overall.accuracy,
            f"{overall.reported:,}",
            100 * self.min_ratio,
            named,
        )


def _sum(tallies: Iterable[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.merge(t)
    return out
