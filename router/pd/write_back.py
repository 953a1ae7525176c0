"""Whether a decode writes a request's KV back to its prefill (PD-Caching-3), per request.

A write-back pays when a later prompt reuses the answer on that prefill (multi-round QA,
where each prompt holds the last answer); on traffic whose prompts never hold an answer it
moves KV and fills the prefill's cache for nothing. The prefills report what they served
from written-back pages (`written_back_tokens` in each answer), so the router keeps, per
prefill, the written-back tokens reused per write-back it asked for, and asks for one only
while that yield is worth it. While closed, every `explore_every`-th request still writes
back, so traffic that starts reusing answers opens the gate again. A prefill whose answers
do not report the field (a real SGLang server) cannot be measured: it always gets them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WriteBack(enum.StrEnum):
    """--write-back: `adaptive` asks while written-back pages get reused, `always` asks."""

    ADAPTIVE = "adaptive"
    ALWAYS = "always"


@dataclass(slots=True)
class _Yield:
    """One prefill's moving averages, per request it served."""

    asked: int = 0  # write-backs asked for so far
    skipped: int = 0  # requests the gate kept from writing back so far
    measured: bool = False  # its answers report written_back_tokens
    reused: float = 0.0  # written-back tokens a request reused, moving average
    rate: float = 0.0  # write-backs per request, moving average

    def per_write_back(self) -> float:
        return self.reused / self.rate if self.rate > 0 else 0.0


@dataclass(slots=True)
class WriteBackGate:
    """Per prefill: ask the decode to write back, or not (see the module's docstring)."""

    mode: WriteBack = WriteBack.ADAPTIVE
    warmup: int = 32  # write-backs to a prefill before its yield decides
    min_reused_tokens: float = 16.0  # reused per write-back for the gate to stay open
    explore_every: int = 8
    weight: float = 1 / 64  # of the newest request in the moving averages
    _prefills: dict[str, _Yield] = field(default_factory=dict)

    def ask(self, prefill: str) -> str:
        """The decision for a request served by `prefill`: `asked`, `explored` (closed but
        sampled) or `skipped`; the first two mean the decode writes back."""
        y = self._prefills.setdefault(prefill, _Yield())
        if (
            self.mode is WriteBack.ALWAYS
            or not y.measured
            or y.asked < self.warmup
            or y.per_write_back() >= self.min_reused_tokens
        ):
            y.asked += 1
            return "asked"
        y.skipped += 1
        if y.skipped % self.explore_every == 0:
            y.asked += 1
            return "explored"
        return "skipped"

    def observe(self, prefill: str, wrote_back: bool, reused: int | None) -> None:
        """A request's end: whether it wrote back, and the written-back tokens its prefill
        reused for it (None: the answer does not say)."""
        y = self._prefills.setdefault(prefill, _Yield())
        if reused is None:
            return
        y.measured = True
        w = self.weight
        y.reused += w * (reused - y.reused)
        y.rate += w * (float(wrote_back) - y.rate)

    def reuse_per_write_back(self, prefill: str) -> float | None:
        """The moving yield of `prefill`'s write-backs (None before it reports one)."""
        y = self._prefills.get(prefill)
        return y.per_write_back() if y is not None and y.measured else None
