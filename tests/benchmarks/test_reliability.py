"""The reliability benchmark run end to end (--quick): every fault scenario and bad input
passes. A fault passes when no request hung, each got its answer (first try or a retry) or
a clear error, no MemPool block was left held on a surviving worker, and the pool healed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.runs import quick_results

out_dir, results = quick_results("reliability", timeout=600, json_name="results")

SCENARIOS = {
    "worker killed before the request",
    "worker killed mid-request",
    "worker killed after streaming",
    "worker hangs (accepts, never answers)",
    "health flapping",
    "router restarted under load",
    "decode killed during the KV transfer",
    "prefill killed after the hand-off",
}


def test_files_are_written(out_dir: Path) -> None:
    for name in ("results.json", "results.md"):
        assert (out_dir / name).stat().st_size > 0
    page = (out_dir / "results.md").read_text()
    assert "## Faults" in page and "## Bad inputs" in page


def test_every_scenario_ran(results: dict[str, Any]) -> None:
    assert results["mode"] == "quick"
    assert {f["scenario"] for f in results["faults"]} == SCENARIOS


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_passes(results: dict[str, Any], scenario: str) -> None:
    (f,) = [f for f in results["faults"] if f["scenario"] == scenario]
    assert f["error"] is None, f
    assert f["requests"] > 0 and f["unclear"] == 0, f  # every request: an answer or a clear error
    assert f["slowest_s"] <= f["bound_s"], f  # no hang
    assert f["leaked_blocks"] == 0, f
    assert f["healed"], f
    assert f["expectation_met"], f
    assert f["passed"]


def test_every_bad_input_gets_a_clear_4xx_or_an_answer(results: dict[str, Any]) -> None:
    inputs = results["inputs"]
    assert {i["target"] for i in inputs} == {"router", "worker"}
    failed = [i for i in inputs if not (i["passed"] and i["still_serving"])]
    assert not failed, failed
    for i in inputs:
        assert i["status"] is not None and i["status"] < 500, i


def test_counts_add_up(results: dict[str, Any]) -> None:
    counts = results["counts"]
    assert counts["faults_tried"] == len(SCENARIOS) == counts["faults_passed"]
    assert counts["inputs_tried"] == len(results["inputs"]) == counts["inputs_passed"]
