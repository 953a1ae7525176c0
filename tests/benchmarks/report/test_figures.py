"""Plots: written without a display, each system in one colour on every plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report.figures import color, pyplot, save


def test_a_system_keeps_its_colour_and_a_plot_is_written(tmp_path: Path) -> None:
    first, second = color("test system a"), color("test system b")
    assert first != second
    assert color("test system a") == first
    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [1, 0], color=first)
    assert save(fig, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
