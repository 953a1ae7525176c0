"""The overload ramp: its quick preset end to end, and its arithmetic on made-up numbers.

The end-to-end run checks the files, one row per step and system, sane counts, and that ours
with the deadline refused requests at the top step (twice the sustained rate in the quick
preset: the admission must act there). Timings are not asserted. The unit tests pin what
goodput, wait, the SLO, the calibration's verdicts and the targets compute, so a change in
their definitions shows here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from benchmarks.load.causal import RunResult, run_workload
from benchmarks.load.retry import NO_RETRY
from benchmarks.multiturn.cluster import scaled_cost_args
from benchmarks.multiturn.workloads import COMPLETION, Request
from benchmarks.overload import calibrate
from benchmarks.overload.preset import (
    CACHE_AWARE,
    WITH_DEADLINE,
    WITHOUT_DEADLINE,
    Calibration,
    systems,
)
from benchmarks.overload.slo import ERROR, OK, REFUSED, Sample, figures, status_of, steady_rps
from benchmarks.overload.targets import (
    Workers,
    goodput_kept,
    paired_ratios,
    wait_within,
)
from benchmarks.overload.workload import Pool, step_workload
from router.policies import CostModel
from tests.benchmarks.runs import PNG_MAGIC, finite, quick_results
from tests.benchmarks.test_load import Refusing, chat_workload, serving

out_dir, results = quick_results("overload", timeout=300, json_name="results")

SYSTEMS = (WITH_DEADLINE, WITHOUT_DEADLINE, CACHE_AWARE)


# --------------------------------------------------------------------------- end to end


def test_files_and_one_row_per_step_and_system(out_dir: Path, results: dict[str, Any]) -> None:
    assert (out_dir / "overload.png").read_bytes().startswith(PNG_MAGIC)
    page = (out_dir / "results.md").read_text()
    for heading in ("## Targets", "## Calibration of the sustained rate", "## Every run"):
        assert heading in page
    command = results["command"]  # the exact command, on the page too
    assert command.startswith("python -m benchmarks.overload") and "--quick" in command
    assert f"`{command}`" in page
    assert "/work/" not in page and "/work/" not in (out_dir / "results.json").read_text()
    setup = results["setup"]
    assert setup["preset"] == "quick"
    assert finite(setup["sustained_rps"]) and setup["sustained_rps"] > 0
    assert finite(setup["deadline_s"]) and setup["deadline_s"] > 0
    assert setup["calibration"], "the sustained rate was not measured"
    fractions = setup["fractions"]
    seen = {(r["fraction"], r["system"]) for r in results["runs"]}
    assert seen == {(f, s) for f in fractions for s in SYSTEMS}, seen


def test_counts_add_up(results: dict[str, Any]) -> None:
    for run in results["runs"]:
        where = f"{run['system']} at {run['fraction']:.0%}"
        assert run["requests"] > 0, where
        assert run["admitted"] + run["refused"] == run["requests"], where
        assert run["completed"] + run["errors"] == run["admitted"], where
        assert run["errors"] == 0, f"{where}: {run['error_samples']}"
        assert 0 <= run["good"] <= run["completed"], where
        assert run["goodput_rps"] <= run["throughput_rps"] + 1e-9, where
        assert run["ttft_p50_s"] <= run["ttft_p99_s"], where
        assert run["wait_max_s"] <= run["ttft_max_s"] + 1e-9, where
    same: dict[float, set[int]] = {}
    for run in results["runs"]:  # every system got the same requests at a step
        same.setdefault(run["fraction"], set()).add(run["requests"])
    assert all(len(counts) == 1 for counts in same.values()), same


def test_the_deadline_refuses_at_the_top_step(results: dict[str, Any]) -> None:
    top = max(results["setup"]["fractions"])
    runs = {r["system"]: r for r in results["runs"] if r["fraction"] == top}
    ours = runs[WITH_DEADLINE]
    assert ours["refused"] > 0, "ours with the deadline refused nothing at the top step"
    refusals = {k: v for k, v in ours["router_admission"].items() if k.startswith("refusals:")}
    assert sum(refusals.values()) == ours["refused"], refusals  # the router says the same
    for other in (WITHOUT_DEADLINE, CACHE_AWARE):
        assert runs[other]["refused"] == 0, f"{other} has no admission, yet refused"


def test_targets_are_reported(results: dict[str, Any]) -> None:
    for name in ("goodput_past_saturation", "wait_within_deadline"):
        t = results["targets"][name]
        assert {"value", "limit", "met", "about", "detail"} <= set(t)
        if t["met"] is False:
            assert t.get("why"), f"{name} missed without a reason"
    ratios = results["goodput_vs_cache_aware"][WITH_DEADLINE]
    assert len(ratios) == len(results["setup"]["fractions"])


# --------------------------------------------------------------------------- arithmetic


def sample(
    status: str = OK, sent: float = 0.0, ttft: float = 1.0, floor: float = 0.5, own: float = 0.4
) -> Sample:
    end = sent + ttft + 1.0 if status == OK else None
    return Sample(status, sent, ttft if status == OK else None, end, floor, own, 1000, 200)


def test_wait_slo_and_statuses() -> None:
    s = sample(ttft=3.0, floor=0.5, own=0.4)
    assert s.wait_s == pytest.approx(2.6)  # TTFT minus its own prefill
    assert s.good(deadline_s=2.5)  # SLO: floor 0.5 + D 2.5 = 3.0
    assert not s.good(deadline_s=2.49)
    assert sample(REFUSED).wait_s is None and not sample(REFUSED).good(10.0)
    assert status_of("ok") == OK
    assert status_of("http_429") == REFUSED
    assert status_of("http_503") == ERROR
    assert status_of("connection") == ERROR


def test_figures_of_a_run() -> None:
    samples = [
        sample(sent=0.0, ttft=1.0),  # good (SLO 0.5 + 2 = 2.5), wait 0.6
        sample(sent=1.0, ttft=3.0),  # late: wait 2.6 > D
        sample(REFUSED, sent=2.0),
        sample(ERROR, sent=3.0),
        sample(sent=4.0, ttft=0.5),  # good, ends at 5.5
    ]
    f = figures(samples, deadline_s=2.0)
    assert (f["requests"], f["admitted"], f["refused"], f["errors"]) == (5, 4, 1, 1)
    assert (f["completed"], f["good"], f["over_deadline"]) == (3, 2, 1)
    assert f["span_s"] == pytest.approx(5.5)  # first send 0 to the last end 5.5
    assert f["goodput_rps"] == pytest.approx(2 / 5.5)
    assert f["throughput_rps"] == pytest.approx(3 / 5.5)
    assert f["wait_max_s"] == pytest.approx(2.6)
    assert f["ttft_max_s"] == pytest.approx(3.0)
    assert f["slo_share"] == pytest.approx(2 / 3)
    assert f["hit_ratio"] == pytest.approx(0.2)
    assert f["computed_tokens"] == 2400


def test_steady_rate_leaves_out_the_start_and_the_drain() -> None:
    # sends at 0..8 s, first tokens 1 s later: the settled window is 2..8 s
    samples = [Sample(OK, float(t), 1.0, float(t) + 5.0) for t in range(9)]
    samples.append(Sample(OK, 8.0, 20.0, 30.0))  # a first token long after the last send
    samples.append(Sample(REFUSED, 5.0))
    assert steady_rps(samples) == pytest.approx(7 / 6)  # first tokens at 2..8: seven
    assert steady_rps(samples[:1]) is None


def test_calibration_stops_where_throughput_stops_growing() -> None:
    capacity = 5.0

    def measure(rate: float) -> tuple[float, float | None]:
        return min(rate, capacity), 1.0  # a cluster that saturates at 5 req/s

    rungs = calibrate.climb(2.0, Calibration(10.0, growth=1.25, refine=True), measure)
    rates = [round(r.rate, 3) for r in rungs]
    assert rates == [2.0, 2.5, 3.125, 3.906, 4.883, 6.104, 5.459], rates
    assert [r.held for r in rungs] == [True] * 5 + [False, False]
    assert calibrate.sustained_rate(rungs) == pytest.approx(4.8828125)
    assert "stopped growing" in rungs[-2].why


def test_calibration_stops_on_the_slo_and_starts_lower_when_the_first_rung_fails() -> None:
    def measure(rate: float) -> tuple[float, float | None]:
        return rate, 1.0 if rate < 3 else 0.2  # the median misses its SLO from 3 req/s

    rungs = calibrate.climb(4.0, Calibration(10.0, growth=2.0, refine=False), measure)
    assert [r.rate for r in rungs] == [4.0, 1.0, 2.0, 4.0]
    assert [r.held for r in rungs] == [False, True, True, False]
    assert calibrate.sustained_rate(rungs) == 2.0
    assert rungs[0].why == "the median request missed its TTFT SLO"


def runs_of(goodputs: dict[float, list[float]], system: str = WITH_DEADLINE) -> list[Any]:
    return [
        {"system": system, "fraction": f, "seed": seed, "goodput_rps": g}
        for f, values in goodputs.items()
        for seed, g in enumerate(values, 1)
    ]


def steps_of(runs: list[dict[str, Any]]) -> dict[float, dict[int, dict[str, Any]]]:
    out: dict[float, dict[int, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["fraction"], {})[r["seed"]] = r
    return out


def test_goodput_target() -> None:
    held = steps_of(
        runs_of({0.5: [2, 2, 2], 1.0: [4, 4.2, 3.8], 1.25: [3.9, 4, 3.7], 1.5: [3.7, 3.6, 3.8]})
    )
    t = goodput_kept(held)
    assert t["met"] is True
    assert t["value"] == pytest.approx(3.7 / 4.0)  # median at 150% over the peak median
    assert t["spread"][0] == pytest.approx(3.6 / 4.2)  # seed 2: its own peak 4.2
    fell = steps_of(runs_of({1.0: [4.0], 1.25: [3.0], 1.5: [1.0]}))
    t = goodput_kept(fell)
    assert t["met"] is False and t["value"] == pytest.approx(0.25)
    assert t.get("why")
    assert goodput_kept(steps_of(runs_of({0.5: [1.0]})))["met"] is None  # nothing past 100%


def test_wait_target() -> None:
    workers = Workers(prefill_s_per_token=1e-4, chunk_tokens=8192)
    assert workers.step_s == pytest.approx(0.8192)
    within = {
        1.5: {
            1: {"seed": 1, "fraction": 1.5, "wait_max_s": 1.9, "over_deadline": 0, "completed": 9}
        }
    }
    t = wait_within(within, 2.0, workers)
    assert t["met"] is True and t["value"] == pytest.approx(0.95)
    late = {
        "seed": 2,
        "fraction": 1.25,
        "wait_max_s": 3.0,
        "wait_p99_s": 2.5,
        "over_deadline": 2,
        "completed": 9,
        "computed_tokens": 10_000,
        "busy_s": 2.0,
        "longest_waits": [{"wait_s": 3.0, "ttft_s": 3.5, "own_prefill_s": 0.5}],
    }
    t = wait_within({1.25: {2: late}, **within}, 2.0, workers)
    assert t["met"] is False and t["value"] == pytest.approx(1.5)
    assert "2 of 18" in t["detail"]
    assert workers.priced(late) == pytest.approx(0.5)  # 10,000 x 0.1 ms of 2 s busy
    assert "50%" in t["why"]


def test_paired_ratios_to_cache_aware() -> None:
    runs = runs_of({1.0: [4.0, 3.0], 1.5: [3.0, 3.0]}) + runs_of(
        {1.0: [2.0, 3.0], 1.5: [1.0, 0.0]}, CACHE_AWARE
    )
    ratios = paired_ratios(runs, WITH_DEADLINE)
    assert ratios[1.0] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert ratios[1.5] == {"median": 3.0, "min": 3.0, "max": 3.0}  # a zero is no ratio


def test_steps_offer_the_same_requests_at_the_same_times() -> None:
    def row(rid: int, session: str, turn: int, parent: int | None = None) -> Request:
        return Request(rid, session, turn, 0.0, 8, COMPLETION, parent, prompt="x", prompt_ids=[1])

    a = (row(10, "a", 0), row(11, "a", 1, 10), row(12, "a", 2, 11))
    pool = Pool(7, (a, (row(20, "b", 0),), (row(30, "c", 0),)), {})
    assert len(pool) == 5
    assert [len(s) for s in pool.take(4)] == [3, 1]
    one = step_workload(pool, 2.0, 4, "1.0")
    two = step_workload(pool, 2.0, 4, "1.0")
    assert [(r.session, r.turn, r.at_s) for r in one.requests] == [
        (r.session, r.turn, r.at_s) for r in two.requests
    ]
    assert [r.rid for r in one.requests] == [0, 1, 2, 3]
    turns = [r for r in one.requests if r.session == "a"]
    assert [r.turn for r in turns] == [0, 1, 2]  # a session's turns keep their order
    # open loop: no row waits for another's answer
    assert [r.parent for r in turns] == [None, None, None]
    assert one.params["arrivals"] == "open loop"
    assert one.params["rate"] == 2.0 and one.params["requests"] == 4
    with pytest.raises(ValueError, match="needs 6 requests"):
        step_workload(pool, 2.0, 6, "x")


def test_systems_and_their_flags() -> None:
    specs = systems(2.5, 0)
    assert [s.name for s in specs] == list(SYSTEMS)
    deadline = specs[0].args
    assert deadline[deadline.index("--max-expected-wait-secs") + 1] == "2.500"
    assert deadline[deadline.index("--queue-size") + 1] == "0"
    assert not specs[1].args and not specs[2].args


def test_ours_get_the_cost_model_at_the_workers_time_scale() -> None:
    """Both of ours run with the sim's H100 terms times the scale (the cluster adds them),
    the report's flags are the ones the router got."""
    cost = scaled_cost_args(4.0)
    value = dict(zip(cost[::2], cost[1::2], strict=True))
    assert float(value["--prefill-secs-per-token"]) == pytest.approx(4 * 4.0e-5)
    busy = CostModel().busy_s_per_request
    assert float(value["--busy-secs-per-request"]) == pytest.approx(4 * busy)
    assert scaled_cost_args(1.0) == []


@pytest.mark.parametrize("orphans", [True, False])
def test_a_turn_whose_previous_turn_was_refused_is_still_sent(orphans: bool) -> None:
    """The ramp's client never retries, and a refusal must not remove the next turn: with
    `orphans` it goes at its own time (here refused as well: every first try is)."""
    handler = Refusing(refusals=1)

    async def scenario() -> RunResult:
        async with serving(handler) as url:
            workload = chat_workload(turns=2)
            return await run_workload(
                url, workload, "m", timeout_s=10, retry=NO_RETRY, orphans=orphans
            )

    first, second = asyncio.run(scenario()).records
    assert first.outcome == "http_429"
    if orphans:
        assert "s0/1" in handler.tries  # sent, without the refused turn's messages
        assert second.outcome == "http_429"
    else:
        assert "s0/1" not in handler.tries
        assert second.problem == "not_sent: its previous turn failed"
