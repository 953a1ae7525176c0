"""The transfer benchmark runs end to end in quick mode and writes sane, verified results.

Timings are not judged (shared machines are noisy); what is checked: every transfer was
verified byte for byte, call counts are exact (discrete / aggregated = 2*L), rates are
positive and ordered, and the files have the promised structure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tests.benchmarks.runs import PNG_MAGIC, quick_results

NAME = "transfer"
SHAPES = {"SmolLM2-135M": (30, 3, 64), "Llama-2-13B": (40, 40, 128)}
SYSTEM_CASES = ("discrete", "aggregated", "merged", "aggregated_read")


out_dir, figures = quick_results(NAME, timeout=300)


def systems(figures: dict[str, Any]) -> list[str]:
    return ["tcp", "mooncake"] if figures["mooncake"]["available"] else ["tcp"]


def test_files_exist_and_plot_is_png(out_dir: Path) -> None:
    for suffix in ("json", "md", "png"):
        path = out_dir / f"{NAME}.{suffix}"
        assert path.is_file() and path.stat().st_size > 0, path
    assert (out_dir / f"{NAME}.png").read_bytes().startswith(PNG_MAGIC)


def test_models_and_shapes(figures: dict[str, Any]) -> None:
    assert figures["mode"] == "quick" and figures["reps"] >= 2
    assert set(figures["models"]) == set(SHAPES)
    for name, (layers, heads, dim) in SHAPES.items():
        m = figures["models"][name]
        assert (m["layers"], m["kv_heads"], m["head_dim"], m["page_size"]) == (
            layers,
            heads,
            dim,
            16,
        )
        assert m["dtype"] in ("float16", "bfloat16")
        assert m["bytes"] == m["tokens"] * 2 * layers * heads * dim * 2
        assert m["pages"] * 16 == m["tokens"]
    assert figures["models"]["SmolLM2-135M"]["tokens"] == 2048


def test_mooncake_measured_or_reason_given(figures: dict[str, Any]) -> None:
    mooncake = figures["mooncake"]
    for model in figures["models"].values():
        present = {k for k in model["cases"] if k.startswith("mooncake")}
        if mooncake["available"]:
            assert present == {f"mooncake_{c}" for c in SYSTEM_CASES}
        else:
            assert not present and mooncake["reason"]


def test_every_transfer_verified(figures: dict[str, Any]) -> None:
    for name, model in figures["models"].items():
        expected = {"raw_socket", *(f"{s}_{c}" for s in systems(figures) for c in SYSTEM_CASES)}
        assert set(model["cases"]) == expected, name
        for key, case in model["cases"].items():
            assert case["verified"] is True, (name, key)
            assert case["reps"] == figures["reps"], (name, key)


def test_rates_positive_and_ordered(figures: dict[str, Any]) -> None:
    for name, model in figures["models"].items():
        for key, c in model["cases"].items():
            rates = c["gbps"]
            assert len(rates) == c["reps"] and all(math.isfinite(r) and r > 0 for r in rates)
            assert c["gbps_min"] <= c["gbps_median"] <= c["gbps_max"], (name, key)
            assert c["gbps_min"] == min(rates) and c["gbps_max"] == max(rates)


def test_call_counts_exact(figures: dict[str, Any]) -> None:
    for name, model in figures["models"].items():
        layers, pages = model["layers"], model["pages"]
        cases = model["cases"]
        assert cases["raw_socket"]["calls"] == 1
        for system in systems(figures):
            assert cases[f"{system}_discrete"]["calls"] == pages * 2 * layers, (name, system)
            assert cases[f"{system}_aggregated"]["calls"] == pages, (name, system)
            assert cases[f"{system}_aggregated_read"]["calls"] == pages, (name, system)
            assert cases[f"{system}_merged"]["calls"] == 1, (name, system)  # one contiguous run
            assert model["ratios"][f"{system}_discrete_over_aggregated_calls"] == 2 * layers


def test_targets_reported_not_asserted(figures: dict[str, Any]) -> None:
    for model in figures["models"].values():
        targets = model["ratios"]["targets"]
        assert targets["discrete_over_aggregated_calls"]["met"] is True
        assert targets["tcp_aggregated_over_raw"]["target"] == 0.7
        for t in targets.values():
            assert isinstance(t["met"], bool)
        value = targets["tcp_aggregated_over_raw"]["value"]
        assert math.isfinite(value) and value > 0


def test_markdown_tables(out_dir: Path, figures: dict[str, Any]) -> None:
    text = (out_dir / f"{NAME}.md").read_text()
    lines = text.splitlines()
    assert "| model | case | network calls | MB | GB/s median | min | max | verified |" in lines
    assert "## Ratios and targets" in text
    for name in figures["models"]:
        for label in ("raw socket copy", "tcp discrete", "tcp aggregated", "tcp merged"):
            assert any(line.startswith(f"| {name} | {label} |") for line in lines), (name, label)
        assert any(f"| {name} | discrete_over_aggregated_calls |" in line for line in lines)
