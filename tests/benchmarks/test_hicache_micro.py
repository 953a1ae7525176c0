"""The HiCache micro-benchmark runs end to end (quick mode) and writes its three files."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import hicache_micro


def test_quick_run_writes_json_markdown_and_png(tmp_path: Path) -> None:
    assert hicache_micro.main(["--out", str(tmp_path), "--quick"]) == 0
    figures = json.loads((tmp_path / "hicache_micro.json").read_text())
    assert figures["all_bytes_verified"] is True
    for system in hicache_micro.SYSTEMS:
        for op in ("set", "get"):
            entry = figures["results"][system][op]
            assert len(entry["seconds"]) == hicache_micro.QUICK["repeats"]
            assert (
                entry["gb_per_s"]["min"] <= entry["gb_per_s"]["median"] <= entry["gb_per_s"]["max"]
            )
    assert "sglang HiCacheFile" in (tmp_path / "hicache_micro.md").read_text()
    assert (tmp_path / "hicache_micro.png").stat().st_size > 1000
