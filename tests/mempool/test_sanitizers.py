"""The native tree's and the native decision's own tests once more, built with
AddressSanitizer and UndefinedBehaviorSanitizer (scripts/sanitize.sh): a memory error or
undefined behaviour that happens to leave the results right still fails here. About a
minute, most of it the build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("g++", "cmake", "ninja")),
    reason="needs g++, cmake and ninja (scripts/install.sh's build tools)",
)
def test_native_tree_and_decision_tests_pass_under_asan_and_ubsan() -> None:
    run = subprocess.run(
        [
            "bash",
            "scripts/sanitize.sh",
            "tests/mempool/test_radix_native.py",
            "tests/router/test_decide_native.py",
            "-x",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "sanitized build" in out and " passed" in out
    assert "runtime error" not in out and "AddressSanitizer" not in out
