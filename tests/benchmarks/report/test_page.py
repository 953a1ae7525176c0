"""Every result: a JSON and a page, stamped with the commit and the machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.report.page import machine_facts, publish, write_results


def test_results_show_the_home_directory_as_a_tilde(tmp_path: Path) -> None:
    """A server's message quoted in a result may name a file under the home directory (a
    model's path as its id): every benchmark's files show it as ~, in JSON and Markdown."""
    model = str(Path.home() / ".cache" / "model")
    row = {"answer": f"model 'x' not found; served: ['{model}']"}
    json_path, md_path = write_results(tmp_path, "r", {"rows": [row]}, [row], "T", [])
    for path in (json_path, md_path):
        text = path.read_text()
        assert str(Path.home()) + os.sep not in text, path
        assert f"~{os.sep}.cache{os.sep}model" in text, path


def test_a_result_is_stamped_with_the_machine_it_was_measured_on(tmp_path: Path) -> None:
    facts = machine_facts()
    assert facts["cpu_count"] == os.cpu_count()
    assert len(facts["git_commit"]) >= 7  # the tests run in a checkout
    elsewhere = {"cpu_count": 64, "git_commit": "abc1234"}
    json_path, md_path = write_results(
        tmp_path, "r", {"x": float("nan")}, None, "T", ["a note"], elsewhere
    )
    assert json.loads(json_path.read_text()) == {"x": None, "machine": elsewhere}
    page = md_path.read_text()
    assert page.startswith("# T\n")
    assert "- a note" in page
    assert page.endswith("## Machine\n\n- cpu_count: 64\n- git_commit: abc1234\n")


def test_published_plots_follow_the_body(tmp_path: Path) -> None:
    publish(tmp_path, {"plots": ["a.png"]}, "T", ["body"], [], {"m": 1}, page="README.md")
    page = (tmp_path / "README.md").read_text()
    assert page.index("body") < page.index("![a.png](a.png)") < page.index("## Machine")
    assert (tmp_path / "results.json").exists()
