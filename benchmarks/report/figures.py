"""Plots: matplotlib without a display, one colour per system on every plot of a page."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn (a
    benchmark's figures never depend on it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 110) -> bool:
    """Write `fig` and free it (a page draws many)."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return True


_COLORS: dict[str, str] = {}
# matplotlib's ten, then five darker ones: the full multiturn preset compares twelve systems
_PALETTE = [f"C{i}" for i in range(10)] + ["black", "#843c39", "#393b79", "#637939", "#e7ba52"]


def color(system: str) -> str:
    """One colour per system in every plot (in the order systems are first seen)."""
    if system not in _COLORS:
        _COLORS[system] = _PALETTE[len(_COLORS) % len(_PALETTE)]
    return _COLORS[system]
