"""`python -m benchmarks SUITE`: one command for every benchmark, each suite's flags its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.__main__ import SUITES, main
from tests.benchmarks.runs import REPO_ROOT


def test_listing_names_every_suite_and_its_results_folder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    listed = capsys.readouterr().out
    for name, suite in SUITES.items():
        assert f"  {name} " in listed and f"benchmarks/results/{suite.folder}/" in listed


def test_an_unknown_suite_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-suite"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite 'no-such-suite'" in err and "overload" in err


def test_every_results_folder_is_a_suites() -> None:
    """No results folder is left without the command that rewrites it."""
    committed = {p.name for p in (REPO_ROOT / "benchmarks" / "results").iterdir() if p.is_dir()}
    shapes = {"multiturn_hot_prefix_2p2d", "multiturn_pd_trace", "multiturn_replicas"}
    assert committed - shapes <= {s.folder for s in SUITES.values()}


@pytest.mark.parametrize("name", sorted(SUITES))
def test_each_suite_takes_quick_and_out(name: str) -> None:
    """Every suite answers --help through the one command, and takes --quick and --out."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--quick" in done.stdout and "--out" in done.stdout, done.stdout
