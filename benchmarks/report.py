"""Result files shared by every benchmark: one JSON for machines, one Markdown page for people.

Every benchmark writes the same pair so that results from different runs and machines can be
diffed and compared without per-benchmark parsing code. Only the standard library is used, so
writing results never depends on an optional package (orjson is not guaranteed installed).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

_REPO_ROOT = Path(__file__).resolve().parents[1]


def machine_facts() -> dict[str, Any]:
    """Where and when the figures were taken: timings mean little without the machine."""
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "timestamp_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    facts.update(_git_state())
    return facts


def _git_state() -> dict[str, Any]:
    """Commit and dirty flag, so a figure can be traced to the code it measured."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": dirty}


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
    )
    return done.stdout.strip()


def jsonable(value: Any) -> Any:
    """Non-finite floats become None: json would otherwise emit NaN, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


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


def write_results(
    out_dir: Path,
    name: str,
    figures: dict[str, Any],
    table_rows: list[dict[str, Any]],
    title: str,
    notes: list[str],
    machine: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write `{name}.json` (the figures plus a `machine` entry: this one's, unless the figures
    were measured elsewhere) and `{name}.md`; return both.

    JSON uses sorted keys and indentation so that two runs diff line by line.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine or machine_facts()
    payload = jsonable({**figures, "machine": facts})
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")

    parts = [f"# {title}", "", markdown_table(table_rows), ""]
    if notes:
        parts += ["## Notes", "", *(f"- {note}" for note in notes), ""]
    parts += ["## Machine", "", *(f"- {k}: {format_cell(v)}" for k, v in facts.items()), ""]
    md_path = out_dir / f"{name}.md"
    md_path.write_text("\n".join(parts))
    return json_path, md_path


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def progress_bar(width: int = 38) -> Progress:
    """Progress on stderr; no refresh thread, so nothing competes with the timed loops."""
    return Progress(
        TextColumn(f"[bold]{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        auto_refresh=False,
    )


def step(progress: Progress, task: TaskID) -> None:
    progress.advance(task)
    progress.refresh()
