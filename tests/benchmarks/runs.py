"""Run a benchmark as its operator does (`python -m benchmarks.NAME --out DIR ...` from the
repository root) and read what it wrote; shared by the benchmarks' tests."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def benchmark(name: str, out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m benchmarks.NAME --out OUT ARGS`, its output captured. Past `timeout` the
    benchmark and every server it started are killed (its process group), then
    TimeoutExpired: a plain kill of the benchmark would leave its cluster running."""
    command = [sys.executable, "-m", f"benchmarks.{name}", "--out", str(out), *args]
    with subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def quick_run(name: str, tmp_path_factory: pytest.TempPathFactory, timeout: float) -> Path:
    """The quick preset, run once into a fresh directory, which is returned; a failed run
    fails the caller with the benchmark's output."""
    out = tmp_path_factory.mktemp(name)
    done = benchmark(name, out, "--quick", timeout=timeout)
    assert done.returncode == 0, f"benchmark failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return out


def read_json(path: Path) -> dict[str, Any]:
    figures = json.loads(path.read_text())
    assert isinstance(figures, dict), path
    return figures


def finite(value: Any) -> bool:
    """A real number: not None, not a bool, not NaN or infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def quick_results(name: str, timeout: float, json_name: str | None = None) -> tuple[Any, Any]:
    """The module-scoped fixtures `out_dir` (the quick run's directory, run once for every
    check of a module) and its JSON, named `figures` or, with `json_name`, after it."""
    fixture_name = json_name or "figures"

    @pytest.fixture(scope="module", name="out_dir")
    def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return quick_run(name, tmp_path_factory, timeout)

    @pytest.fixture(scope="module", name=fixture_name)
    def figures(out_dir: Path) -> dict[str, Any]:
        return read_json(out_dir / f"{json_name or name}.json")

    return out_dir, figures


def column_of(md: str, column: str, system: str) -> list[str]:
    """Every value of `column` in the rows of the Markdown tables that have it whose system
    starts with `system` (`ours prompt_tree [PD-Caching-3]` is ours prompt_tree's)."""
    out: list[str] = []
    header: list[str] | None = None
    for line in md.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if column in cells:
            header = cells
        elif not cells:
            header = None
        elif header is not None and cells[0].startswith(system) and len(cells) == len(header):
            out.append(cells[header.index(column)])
    return out


def check_prediction_column(md: str) -> None:
    """Ours' rows show the cached tokens its trees predicted over those the workers reported
    (near 1 on these workloads); the peers', which count neither, show nothing."""
    ours = [v for v in column_of(md, "predicted/reported", "ours prompt_tree") if v != "—"]
    assert ours and all(0.5 <= float(v) <= 1.5 for v in ours), ours
    theirs = column_of(md, "predicted/reported", "sglang-router")
    assert theirs and all(v in ("", "—") for v in theirs), theirs
