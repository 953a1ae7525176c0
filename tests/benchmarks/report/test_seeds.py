"""Figures over seeds: the median with the seeds' min..max, ratios paired within a seed."""

from __future__ import annotations

import math

from benchmarks.report.seeds import median_of, paired, ratio, spread, spread_text


def test_a_spread_leaves_out_what_was_not_measured() -> None:
    assert spread([3.0, None, 1.0, math.nan, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([None]) is None
    assert median_of([4, None, 2]) == 3.0
    assert median_of([]) is None


def test_a_spread_reads_as_its_median_and_range() -> None:
    figure = {"median": 0.5, "min": 0.25, "max": 1.0}
    assert spread_text(figure) == "0.50 [0.25..1.00]"
    assert spread_text(figure, 1, parens=True) == "0.5 (0.2..1.0)"
    assert spread_text(figure, spec=".0%") == "50% [25%..100%]"
    agreed = {"median": 0.5, "min": 0.5, "max": 0.5}
    assert spread_text(agreed) == "0.50"  # the seeds agree: no range
    assert spread_text(agreed, always=True) == "0.50 [0.50..0.50]"
    assert spread_text(None) is None
    assert spread_text({"median": None, "min": None, "max": None}) is None


def test_ratios_are_paired_within_a_seed() -> None:
    mine = {1: {"x": 2.0}, 2: {"x": 3.0}, 3: {"x": 1.0}}
    theirs = {1: {"x": 4.0}, 2: {"x": 0.0}}  # seed 2: nothing to divide by; seed 3 absent
    assert paired(mine, theirs, lambda a, b: ratio(a["x"], b["x"])) == {1: 0.5}
    assert ratio(1.0, None) is None


def test_a_unit_follows_the_median() -> None:
    assert spread_text({"median": 50, "min": 40, "max": 60}, 0, unit="%") == "50% [40..60]"
