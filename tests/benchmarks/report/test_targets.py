"""Targets are reported, never asserted: met is None where nothing was measured."""

from __future__ import annotations

from benchmarks.report.targets import check, target_rows


def test_a_target_is_met_by_its_bound() -> None:
    assert check(0.5, "<=", 0.6)["met"] is True
    assert check(0.7, "<=", 0.6)["met"] is False
    assert check(0.7, ">=", 0.6, "about")["about"] == "about"
    assert check(None, ">=", 0.6)["met"] is None
    assert "about" not in check(1.0, ">=", 0.6)


def test_a_targets_row_shows_the_seeds_range_and_why_only_when_missed() -> None:
    met = {**check(0.5, "<=", 0.6), "spread": [0.4, 0.55], "detail": "d", "why": "w"}
    missed = {**check(0.9, "<=", 0.6), "why": "slow"}
    rows = target_rows({"met": met, "missed": missed})
    assert rows[0]["seeds min..max"] == "0.40..0.55"
    assert rows[0]["limit"] == "<= 0.6"
    assert rows[0]["why missed"] == ""
    assert "seeds min..max" not in rows[1]
    assert rows[1]["why missed"] == "slow"


def test_every_comparison_is_a_bound() -> None:
    assert check(2.0, "<", 2.0)["met"] is False
    assert check(2.0, ">", 1.0)["met"] is True
    assert check(4.0, "==", 4.0)["met"] is True
    assert check(float("nan"), "==", 4.0)["met"] is None
