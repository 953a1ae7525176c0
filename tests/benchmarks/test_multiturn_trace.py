"""The Mooncake trace ships with the repository and results name no machine's paths.

A clone must run the trace benchmarks as is: the default trace is read from the package
(gzipped), whatever the working directory; any trace in Mooncake's format loads gzipped or
plain; and no committed result names a file by where one machine keeps it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.runs import REPO_ROOT

TRACE_ROWS = 12_031  # Mooncake's conversation trace (FAST'25 release)


def test_the_default_trace_ships_with_the_package() -> None:
    from benchmarks.multiturn.trace import DEFAULT_TRACE, load_trace

    assert DEFAULT_TRACE.is_relative_to(REPO_ROOT / "benchmarks")
    assert DEFAULT_TRACE.name.endswith(".jsonl.gz")
    rows = load_trace(DEFAULT_TRACE)
    assert len(rows) == TRACE_ROWS
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    notice = (DEFAULT_TRACE.parent / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in notice and "Apache" in notice
    assert "Apache License" in (DEFAULT_TRACE.parent / "LICENSE").read_text()


def test_the_default_trace_loads_from_any_directory(tmp_path: Path) -> None:
    """As from a user's clone: the path is the package's, not the working directory's."""
    code = "from benchmarks.multiturn.trace import *; print(len(load_trace(DEFAULT_TRACE)))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == TRACE_ROWS


def test_gzipped_and_plain_traces_load_alike(tmp_path: Path) -> None:
    from benchmarks.multiturn.trace import load_trace, trace_name

    rows = [
        {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
        {"timestamp": 1, "input_length": 700, "output_length": 2, "hash_ids": [0, 1]},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    plain, packed = tmp_path / "agent.jsonl", tmp_path / "agent.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    assert load_trace(plain) == load_trace(packed)
    assert [r.timestamp_ms for r in load_trace(packed)] == [1, 5]
    assert trace_name(plain) == trace_name(packed) == "trace:agent"
    packed.write_bytes(gzip.compress(b'{"timestamp": 1}\n'))
    with pytest.raises(ValueError, match=r"agent.jsonl.gz:1: not a Mooncake trace row"):
        load_trace(packed)


def test_results_show_paths_relative_to_the_repository() -> None:
    from benchmarks.harness import shown_command, shown_path
    from benchmarks.multiturn.trace import DEFAULT_TRACE

    assert shown_path(DEFAULT_TRACE) == "benchmarks/multiturn/data/" + DEFAULT_TRACE.name
    assert shown_path("/somewhere/else/mine.jsonl") == "mine.jsonl"
    assert shown_path("relative/mine.jsonl") == "relative/mine.jsonl"
    argv = ["--trace", str(DEFAULT_TRACE), f"--out={REPO_ROOT}/benchmarks/results/x"]
    assert shown_command("python -m b", argv) == (
        f"python -m b --trace benchmarks/multiturn/data/{DEFAULT_TRACE.name} "
        "--out=benchmarks/results/x"
    )
    assert shown_command("python -m b", ["--shapes", "4 colocated"]) == (
        "python -m b --shapes '4 colocated'"
    )
