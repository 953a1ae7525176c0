"""Figures over seeds: a run is repeated on several seeds, and a page shows the median with
the seeds' min..max, so that one lucky seed cannot pass for a result."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from benchmarks.harness import finite

Run = dict[str, Any]


def configs(runs: Iterable[Run]) -> list[str]:
    """The configs the runs name, in the order they first appear."""
    return list(dict.fromkeys(r["config"] for r in runs if r.get("config")))


def ratio(a: Any, b: Any) -> float | None:
    """a / b where both were measured and b is not zero."""
    return a / b if finite(a) and finite(b) and b else None


def median_of(values: Iterable[Any]) -> float | None:
    """The median of the finite values, None without any."""
    kept = [v for v in values if finite(v)]
    return statistics.median(kept) if kept else None


def spread(values: Iterable[Any]) -> dict[str, Any] | None:
    """Median and min..max of the finite per-seed values (None without any)."""
    kept = [v for v in values if finite(v)]
    if not kept:
        return None
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept)}


def spread_text(
    figure: Mapping[str, Any] | None,
    digits: int = 2,
    parens: bool = False,
    always: bool = False,
    spec: str | None = None,
    unit: str = "",
) -> str | None:
    """`median [min..max]` (or `(min..max)`), the median alone where the seeds agree (unless
    `always`); None where nothing was measured. `spec` formats each number instead of
    `digits`; `unit` follows the median."""
    if not figure or not finite(figure.get("median")):
        return None
    fmt = spec or f".{digits}f"
    mid, low, high = (format(figure[k], fmt) for k in ("median", "min", "max"))
    mid += unit
    if figure["min"] == figure["max"] and not always:
        return mid
    return f"{mid} ({low}..{high})" if parens else f"{mid} [{low}..{high}]"


def paired(
    mine: Mapping[int, Run],
    theirs: Mapping[int, Run],
    value: Callable[[Run, Run], Any],
) -> dict[int, float]:
    """seed -> `value(mine's run, theirs)` in the seeds both ran (the same requests), where
    it is a finite number."""
    out = {}
    for seed, run in mine.items():
        if seed in theirs:
            got = value(run, theirs[seed])
            if finite(got):
                out[seed] = got
    return out
