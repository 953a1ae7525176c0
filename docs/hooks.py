"""MkDocs hook: the benchmarks' committed result pages and plots (benchmarks/results/**.md and
**.png) become part of the site under results/, so the docs show the latest figures without
a second copy of the images in git."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in {".md", ".png"}:
            uri = "results/" + path.relative_to(RESULTS).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
