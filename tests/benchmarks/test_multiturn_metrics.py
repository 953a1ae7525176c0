"""A run's figures from its records (benchmarks.multiturn.metrics): the tail says when its
requests were sent, and the warm figures leave the cold start out."""

from __future__ import annotations

import pytest

from benchmarks.load.record import Record
from benchmarks.multiturn.metrics import WARM_UP, summarize, tail, warm
from benchmarks.multiturn.versus import WARM_P99, system_rows, warm_text


def records(ttfts: list[float]) -> list[Record]:
    """One request a second, each with its TTFT, 1,000 prompt tokens, none cached."""
    out = []
    for rid, ttft in enumerate(ttfts):
        record = Record(rid, f"s{rid}", sent_s=float(rid), ttft_s=ttft, e2e_s=ttft + 0.1)
        record.prompt_tokens = 1000
        out.append(record)
    return out


def test_the_warm_figures_leave_out_what_was_sent_in_the_warm_up() -> None:
    """Sent at 0..100 s: the first quarter (0-24 s) is the warm-up, slow; from 25 s on, fast."""
    ttfts = [2.0 if t < 25 else 0.1 for t in range(101)]
    ttfts[90] = ttfts[95] = 0.5
    figures = warm(records(ttfts), (0.0, 100.0))
    assert WARM_UP == 0.25
    assert figures["ttft_warm_mean_s"] == pytest.approx((74 * 0.1 + 2 * 0.5) / 76)
    assert figures["ttft_warm_p99_s"] == pytest.approx(0.5)
    whole = summarize(records(ttfts), [0] * 101, [1000] * 101, 200.0)
    assert whole["ttft_p99_s"] == pytest.approx(2.0)  # the whole run's p99 is the cold start's
    assert whole["ttft_warm_p99_s"] == figures["ttft_warm_p99_s"]
    assert warm([], None) == {"ttft_warm_mean_s": None, "ttft_warm_p99_s": None}


def test_the_tail_says_when_its_requests_were_sent() -> None:
    rows = tail(records([0.1, 3.0, 0.2, 0.1, 2.0]), (0.0, 4.0), fraction=0.4)
    assert [(r["rid"], r["sent_at"]) for r in rows] == [(1, 0.25), (4, 1.0)]
    assert [r["sent_at"] for r in tail(records([1.0, 2.0]), None)] == [None, None]


def test_a_config_with_warm_figures_shows_the_warm_p99_beside_the_baselines() -> None:
    def run(system: str, seed: int, p99: float, warm_p99: float | None) -> dict[str, object]:
        return {
            "system": system,
            "config": "c",
            "seed": seed,
            "available": True,
            "ttft_mean_s": 0.2,
            "ttft_p99_s": p99,
            "reuse_ratio": 0.5,
            "ttft_warm_p99_s": warm_p99,
        }

    runs = [run("a", 1, 1.0, 0.4), run("b", 1, 1.0, 0.8), run("a", 2, 2.0, 0.3)]
    runs.append(run("b", 2, 1.0, 0.6))
    rows, figures = system_rows(runs, "c", "b", "b")
    a = next(f for f in figures if f["system"] == "a")
    assert a["warm_p99_vs_b"] == {1: pytest.approx(0.5), 2: pytest.approx(0.5)}
    assert WARM_P99 in rows[0] and "first 25% of the sending" in warm_text(rows)
    for r in runs:
        r["ttft_warm_p99_s"] = None  # results from before the warm figures: no column
    rows, _ = system_rows(runs, "c", "b", "b")
    assert WARM_P99 not in rows[0] and warm_text(rows) == ""
