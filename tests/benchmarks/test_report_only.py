"""Every committed result a suite can write again from its JSON (`--report-only`) is the page
and the JSON that rewrite makes, byte for byte: the report code and the committed pages agree,
so a change to a writer that would alter a published page fails here until the pages are
written again (and the change shows in their diff)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.benchmarks.runs import REPO_ROOT, benchmark

RESULTS = REPO_ROOT / "benchmarks" / "results"
# folder -> the suite that writes it again from results.json
REWRITABLE = {
    **{
        folder: "multiturn"
        for folder in (
            "multiturn",
            "multiturn_capacity",
            "multiturn_hot_prefix",
            "multiturn_hot_prefix_2p2d",
            "multiturn_lora",
            "multiturn_pd",
            "multiturn_pd_trace",
            "multiturn_replicas",
            "multiturn_sweep",
            "multiturn_tenants",
        )
    },
    "overload": "overload",
}


@pytest.mark.parametrize("folder", sorted(REWRITABLE))
def test_a_committed_page_is_what_its_json_makes(folder: str, tmp_path: Path) -> None:
    committed = RESULTS / folder
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    done = benchmark(REWRITABLE[folder], tmp_path, "--report-only", timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    pages = sorted(p.name for p in committed.glob("*.md"))
    assert pages, f"{folder} has no page"
    for name in [*pages, "results.json"]:
        if name == "policy_replay.md":  # written by the policy replay, not by --report-only
            continue
        rewritten = (tmp_path / name).read_text()
        assert rewritten == (committed / name).read_text(), (
            f"benchmarks/results/{folder}/{name} differs from what --report-only writes from "
            f"its results.json: write it again (`python -m benchmarks.{REWRITABLE[folder]} "
            f"--report-only --out benchmarks/results/{folder}`) and commit the change"
        )
