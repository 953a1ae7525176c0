"""Targets: a figure against a bound, reported with its value and whether it was met, never
asserted (a benchmark measures; a missed target is a finding with its reasons, not a crash)."""

from __future__ import annotations

import operator
from typing import Any

from benchmarks.harness import finite
from benchmarks.report.table import rounded

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq}


def check(value: Any, op: str, limit: float, about: str | None = None) -> dict[str, Any]:
    """A target's record: `value op limit`, met None where the value was not measured."""
    met = OPS[op](value, limit) if finite(value) else None
    out = {"value": value, "op": op, "limit": limit, "met": met}
    if about is not None:
        out["about"] = about
    return out


def target_rows(targets: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per target: value, the seeds' min..max where it is a median over
    seeds, the bound, met, its figures and why it was missed."""
    rows = []
    for name, t in targets.items():
        row = {"target": name, "value": rounded(t.get("value"), 3)}
        if "spread" in t:
            lo, hi = t["spread"]
            row["seeds min..max"] = f"{lo:.2f}..{hi:.2f}" if finite(lo) and finite(hi) else None
        row["limit"] = f"{t['op']} {t['limit']:g}"
        row["met"] = t.get("met")
        row["figures"] = t.get("detail", "")
        row["why missed"] = t.get("why", "") if t.get("met") is not True else ""
        rows.append(row)
    return rows
