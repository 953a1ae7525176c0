"""Tables: one cell format for every page, columns in the order the rows first name them."""

from __future__ import annotations

import math

from benchmarks.report.table import format_cell, markdown_table, percent, rounded, table_section


def test_cells_read_the_same_on_every_page() -> None:
    assert format_cell(True) == "yes"
    assert format_cell(None) == "—"
    assert format_cell(12345.0) == "12,345"  # a count stored as a float
    assert format_cell(0.123456) == "0.1235"
    assert format_cell("a|b\nc") == r"a\|b c"  # a pipe or a newline would break the row


def test_a_table_has_the_union_of_the_rows_columns_in_first_seen_order() -> None:
    table = markdown_table([{"a": 1, "b": 2}, {"c": 3, "a": 4}])
    assert table.splitlines() == [
        "| a | b | c |",
        "|---|---|---|",
        "| 1 | 2 | — |",
        "| 4 | — | 3 |",
    ]
    assert markdown_table([]) == "_no rows_"
    assert table_section("H", [{"a": 1}])[:2] == ["## H", ""]
    # what the table shows, said between the heading and the table as one paragraph
    said = table_section("H", [{"a": 1}], "Medians over ", "the seeds.")
    assert said[:4] == ["## H", "", "Medians over the seeds.", ""]
    assert said[4].startswith("| a |")


def test_numbers_are_rounded_and_what_was_not_measured_is_kept() -> None:
    assert rounded(1.23456) == 1.235
    assert rounded(1.23456, 1) == 1.2
    assert rounded(None) is None
    assert math.isnan(rounded(math.nan))
    assert percent(0.1234) == "12%"
    assert percent(0.1234, 1) == "12.3%"
    assert percent(None, missing="?") == "?"
