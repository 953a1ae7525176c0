"""The MemPool micro-benchmark runs end to end in quick mode and writes sane result files.

Only the shape and sanity of the results are checked: timings on shared machines are too
noisy for thresholds, so targets are reported by the benchmark, never asserted here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.runs import PNG_MAGIC, quick_results

NAME = "mempool_micro"
POSITIVE_FLOATS = (
    "alloc_ns_per_block",
    "free_ns_per_block",
    "alloc_p50_us",
    "free_p50_us",
    "insert_4k_us",
    "match_4k_us",
    "match_4k_partial_us",
    "aggregate_calls_ratio",
    "index_rss_mib_per_million_tokens",
    "index_tracemalloc_mib_per_million_tokens",
    "memory_tokens_measured",
    "evict_16_us_1m",
    "evict_16_p90_us_1m",
    "expire_us_1m",
    "scale_build_s_1m",
    "scale_peak_rss_mib_1m",
)
TARGETS = (
    "alloc_ns_per_block",
    "insert_4k_us",
    "match_4k_us",
    "index_rss_mib_per_million_tokens",
    "aggregate_calls_ratio",
    "evict_16_us_1m",
)


out_dir, figures = quick_results(NAME, timeout=120)


def test_output_files_exist(out_dir: Path) -> None:
    for suffix in ("json", "md", "png"):
        path = out_dir / f"{NAME}.{suffix}"
        assert path.is_file() and path.stat().st_size > 0, path


@pytest.mark.parametrize("key", POSITIVE_FLOATS)
def test_figure_is_positive_finite_float(figures: dict[str, Any], key: str) -> None:
    value = figures[key]
    assert isinstance(value, float) and not isinstance(value, bool), (key, value)
    assert math.isfinite(value) and value > 0, (key, value)


def test_aggregate_calls_ratio_is_two_per_layer(figures: dict[str, Any]) -> None:
    assert isinstance(figures["layers"], int) and figures["layers"] > 0
    assert figures["aggregate_calls_ratio"] == 2 * figures["layers"]


def test_layout_roundtrip_is_exact(figures: dict[str, Any]) -> None:
    assert figures["layout_roundtrip_exact"] is True


def test_quick_mode_scales_memory_from_fewer_tokens(figures: dict[str, Any]) -> None:
    assert figures["mode"] == "quick"
    assert figures["memory_tokens_measured"] >= 200_000
    assert figures["preload_cached_tokens"] >= 100_000


def test_targets_and_memserve_ratios_reported(figures: dict[str, Any]) -> None:
    targets = figures["targets"]
    for name in TARGETS:
        assert isinstance(targets[name]["met"], bool), name
        assert targets[name]["value"] == figures[name], name
    published = targets["memserve_published"]
    assert published["alloc_ns_per_block"] == 800
    assert published["insert_4k_us_max"] == 700
    for name in ("alloc", "insert"):
        ratio = figures["memserve_ratio"][name]
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, name


def test_eviction_and_expiry_measured_on_a_million_token_index(figures: dict[str, Any]) -> None:
    (point,) = figures["scale"]  # quick mode: 1M only; the full run adds 10M
    assert point["size"] == "1m" and point["tokens"] >= 1_000_000
    assert point["nodes"] > 0 and point["holder_tree_pages"] * 16 >= 1_000_000
    # every timed evict(16) freed something, each at least the 16 blocks asked for
    assert point["evict_freed_blocks_median"] >= 16
    assert point["tokens_after_evictions"] < point["tokens"]
    assert 0.01 <= point["expired_entries_fraction"] <= 0.1  # a small stale fraction
    assert 0 < point["expire_pruned_fraction"] < 0.1  # not the whole tree
    assert figures["targets"]["evict_16_us_1m"]["limit"] == 20
    assert figures["targets"]["evict_16_us_1m"]["op"] == "<"


def test_curves_cover_the_sweeps(figures: dict[str, Any]) -> None:
    assert [p["blocks"] for p in figures["alloc_curve"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    tokens = [p["tokens"] for p in figures["index_curve"]]
    assert tokens == [256, 512, 1024, 2048, 4096, 8192, 16384]


def test_markdown_has_a_row_per_figure(out_dir: Path, figures: dict[str, Any]) -> None:
    lines = (out_dir / f"{NAME}.md").read_text().splitlines()
    assert "| name | value | unit | target | met |" in lines
    for name in (*POSITIVE_FLOATS, "layers", "layout_roundtrip_exact"):
        assert any(line.startswith(f"| {name} |") for line in lines), name


def test_plot_is_a_png(out_dir: Path) -> None:
    assert (out_dir / f"{NAME}.png").read_bytes().startswith(PNG_MAGIC)
