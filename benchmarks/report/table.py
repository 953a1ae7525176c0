"""Markdown tables and their cells: one rendering for every results page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness import finite


def format_cell(value: Any) -> str:
    """Short, stable rendering for table cells (floats to 4 significant digits)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "—"
    if isinstance(value, float):  # whole counts stored as floats read better as counts
        return f"{int(value):,}" if value.is_integer() and abs(value) >= 1e4 else f"{value:.4g}"
    return str(value).replace("|", r"\|").replace("\n", " ")


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A GitHub-flavoured table; columns are the union of the rows' keys, in first-seen order."""
    if not rows:
        return "_no rows_"
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines.extend("| " + " | ".join(format_cell(row.get(c)) for c in columns) + " |" for row in rows)
    return "\n".join(lines)


def table_section(heading: str, rows: Sequence[Mapping[str, Any]], *prose: str) -> list[str]:
    """A `## heading`, a paragraph of `prose` (if any) and the table, as Markdown lines for
    a page's body."""
    said = ["".join(prose), ""] if prose else []
    return [f"## {heading}", "", *said, markdown_table(rows), ""]


def rounded(value: Any, digits: int = 3) -> Any:
    """`value` rounded for a cell; anything not a finite number as it is."""
    return round(value, digits) if finite(value) else value


def percent(value: Any, digits: int = 0, missing: str | None = None) -> str | None:
    """`value` as a percentage for a cell, `missing` where it was not measured."""
    return f"{value:.{digits}%}" if finite(value) else missing
