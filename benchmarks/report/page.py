"""The two files of every result: `NAME.json` for machines and a Markdown page for people,
both stamped with the commit and the machine they were measured on (timings mean little
without the machine). JSON keeps the order the figures were built in (indented, so two runs
diff line by line), so a page written again from its JSON (`--report-only`) is the page the
run wrote; only the standard library writes them, so writing never depends on an optional
package."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO_ROOT, jsonable, without_home
from benchmarks.report.table import format_cell, markdown_table


def machine_facts() -> dict[str, Any]:
    """Where, when and at which commit the figures were taken."""
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "timestamp_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        # the code it ran: a run's own results (tracked, rewritten as it ends) do not count
        code = ("--", ".", ":(exclude)benchmarks/results")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", *code))
    except (OSError, subprocess.SubprocessError):
        return facts
    return {**facts, "git_commit": commit, "git_dirty": dirty}


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
    )
    return done.stdout.strip()


def write_results(
    out_dir: Path,
    name: str,
    figures: dict[str, Any],
    table_rows: list[dict[str, Any]] | None,
    title: str,
    notes: list[str],
    machine: dict[str, Any] | None = None,
    body: Sequence[str] = (),
    page: str | None = None,
) -> tuple[Path, Path]:
    """Write `{name}.json` (the figures plus a `machine` entry: this one's, unless the figures
    were measured elsewhere) and `{name}.md` (or `page`, say README.md); return both.

    The page: the title, the headline table (none when `table_rows` is None), the Markdown
    lines of `body`, the notes, the machine."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine or machine_facts()
    payload = jsonable({**figures, "machine": facts})
    json_path = out_dir / f"{name}.json"
    json_path.write_text(without_home(json.dumps(payload, indent=2) + "\n"))

    parts = [f"# {title}", ""]
    if table_rows is not None:
        parts += [markdown_table(table_rows), ""]
    parts += body
    if notes:
        parts += ["## Notes", "", *(f"- {note}" for note in notes), ""]
    parts += ["## Machine", "", *(f"- {k}: {format_cell(v)}" for k, v in facts.items()), ""]
    md_path = out_dir / (page or f"{name}.md")
    md_path.write_text(without_home("\n".join(parts)))
    return json_path, md_path


def publish(
    out_dir: Path,
    figures: dict[str, Any],
    title: str,
    body: list[str],
    notes: list[str],
    machine: dict[str, Any] | None,
    page: str | None = None,
) -> None:
    """results.json and results.md (or `page`) with no headline table (the body holds it):
    `body` (Markdown lines), then the plots named in `figures["plots"]`, the notes and the
    machine."""
    plots = [f"![{p}]({p})" for p in figures.get("plots") or ()]
    write_results(
        out_dir, "results", figures, None, title, notes, machine, [*body, *plots, ""], page
    )
