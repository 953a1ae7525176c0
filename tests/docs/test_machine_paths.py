"""Results and docs are read on other machines: where this one kept a file is no part of
them (a figure's command, an error sample, an example output)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME_LIKE = re.compile(r"(?<![\w.~])/(?:root|home|work|Users)/")  # a user's own files
SCRATCH = re.compile(r"(?<![\w.~])/tmp/")  # where a run put its output


def texts(*globs: str) -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text(errors="replace")
        for pattern in globs
        for path in sorted(REPO.glob(pattern))
    }


def test_results_name_no_machine_path() -> None:
    results = texts("benchmarks/results/**/*.md", "benchmarks/results/**/*.json")
    assert results
    found = {
        name: match.group(0)
        for name, text in results.items()
        if (match := HOME_LIKE.search(text) or SCRATCH.search(text))
    }
    assert not found, f"machine paths in results: {found}"


def test_docs_name_no_home_directory() -> None:
    docs = texts("README.md", "docs/**/*.md", "deploy/**/*.md")
    found = [name for name, text in docs.items() if HOME_LIKE.search(text)]
    assert not found, f"a home or checkout directory in: {found}"
