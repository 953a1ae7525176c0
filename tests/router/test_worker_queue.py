"""The queue a request joins, as the router measures it: requests not begun (by their first
byte) or reported waiting by the worker, over the rate the worker finishes requests."""

from __future__ import annotations

import time

import pytest

from router.policies import CostModel, PromptTree, RouteRequest, Thresholds
from router.trees import PromptTrees
from router.workers import Worker, WorkerType


def finish(worker: Worker, times: list[float]) -> None:
    for t in times:
        worker.state.finish(t)


def test_a_streamed_request_waits_until_its_first_byte() -> None:
    worker = Worker("http://127.0.0.1:1")
    with worker.request(100, begins_at_first_byte=True) as flight:
        assert worker.unstarted == 1 and worker.waiting == 1
        flight.prefill_done()
        assert worker.unstarted == 0 and worker.in_flight == 1
    assert worker.in_flight == 0 and worker.state.finished == 1
    with worker.request(100) as flight:  # a non-streamed answer: its first byte is its end
        assert worker.unstarted == 0
    with pytest.raises(RuntimeError), worker.request(5, True):
        raise RuntimeError("the worker failed")
    assert worker.unstarted == 0 and worker.state.finished == 2  # a failure is no service


def test_the_service_rate_comes_from_recent_finishes_and_decays_when_they_stop() -> None:
    worker = Worker("http://127.0.0.1:1")
    assert worker.service_rate() is None  # too few to tell
    finish(worker, [10.0, 10.5, 11.0, 11.5, 12.0])
    assert worker.service_rate(now=12.0) == pytest.approx(2.0)
    # nothing finished for 8 s since: 5 in the last 10 s at most
    assert worker.service_rate(now=20.0) == pytest.approx(0.5)


def test_the_measured_wait_is_waiting_requests_over_the_service_rate() -> None:
    worker = Worker("http://127.0.0.1:1")
    now = time.monotonic()
    finish(worker, [now - 2.0 + 0.5 * i for i in range(5)])  # 2 requests a second
    assert worker.measured_wait_s(now) == 0.0  # nobody waits
    worker.reported_waiting = 6  # the worker says 6 wait (for KV memory, say)
    assert worker.measured_wait_s(now) == pytest.approx(3.0)
    # The cost model's queue term takes the longer of its model and the measurement.
    cost = CostModel()
    assert cost.queue_s(worker) == pytest.approx(3.0, rel=0.01)
    worker.reported_waiting = 0
    assert cost.queue_s(worker) == pytest.approx(0.0)


def test_one_request_in_prefill_is_no_wait_beyond_its_modelled_work() -> None:
    """The only request not begun is the one being prefilled: the next waits for its prefill
    (the model's queued tokens), not for a whole request's service time."""
    worker = Worker("http://127.0.0.1:1")
    now = time.monotonic()
    finish(worker, [now - 2.0 + 0.5 * i for i in range(5)])  # 2 requests a second
    cost = CostModel()
    with worker.request(100, begins_at_first_byte=True):
        assert worker.waiting == 1 and worker.measured_wait_s(now) == 0.0
        assert cost.queue_s(worker) == pytest.approx(
            100 * cost.prefill_s_per_token + cost.busy_s_per_request
        )
        with worker.request(100, begins_at_first_byte=True):  # one behind it: measured
            assert worker.measured_wait_s(now) == pytest.approx(0.5)


def test_a_pd_prefills_expected_wait_is_the_work_sent_there() -> None:
    """A prefill answers when its prefill ends, so the router counts each request it sent
    there as not begun until then: measured as a count over the rate, two small hot-prefix
    suffixes would look like two cold prompts. Its queue is the modelled work alone."""
    cost = CostModel()
    now = time.monotonic()
    prefill = Worker("http://127.0.0.1:1", WorkerType.PREFILL)
    colocated = Worker("http://127.0.0.1:2")
    for worker in (prefill, colocated):
        finish(worker, [now - 2.0 + 0.5 * i for i in range(5)])  # 2 requests a second
    with prefill.request(100, True), prefill.request(100, True):
        # the oldest is being prefilled: one waits behind it, half a second at 2/s
        assert prefill.waiting == 2 and prefill.measured_wait_s() == pytest.approx(0.5)
        modelled = 200 * cost.prefill_s_per_token + 2 * cost.busy_s_per_request
        assert cost.queue_s(prefill) == pytest.approx(modelled)
        assert cost.queue_s(prefill) < 0.1
    with colocated.request(100, True), colocated.request(100, True):
        assert cost.queue_s(colocated) == pytest.approx(0.5)  # the longer: the measurement


def test_a_report_stops_counting_the_requests_of_ours_in_it_answered_since() -> None:
    """A worker's load report is up to a load interval old: a sequential client's request
    that it counted has ended here before the client's next one comes. Only requests in
    flight when the report was asked for can be in it."""
    worker = Worker("http://127.0.0.1:1")
    report = {"num_reqs": 1, "num_waiting_reqs": 2, "num_pending_tokens": 300}
    with worker.request(112):
        worker.ask_load()
        worker.apply_load(report)
        assert (worker.load, worker.waiting, worker.queued_tokens) == (3, 2, 300)
    assert (worker.load, worker.waiting, worker.queued_tokens) == (2, 1, 200)
    with worker.request(10), worker.request(10):  # sent after the ask: not in the report
        pass
    assert (worker.load, worker.waiting, worker.queued_tokens) == (2, 1, 200)
    with pytest.raises(OSError), worker.request(10):
        worker.ask_load()
        worker.apply_load(report)
        raise OSError("refused")  # never answered: it may still be counted there
    assert worker.load == 3
    never_asked = Worker("http://127.0.0.1:2")
    with never_asked.request(10):
        never_asked.apply_load({"num_reqs": 1})
    assert never_asked.load == 1  # not asked for: nothing of ours is taken out of it


def test_a_holders_stale_report_of_our_last_request_does_not_move_the_next_off_it() -> None:
    """Measured with a sequential client: one in 5-20 of its requests left the holder of its
    prefix for the load interval after the worker reported the client's previous one."""
    trees = PromptTrees(page_size=16)
    holder, other = Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")
    now = time.monotonic()
    for worker in (holder, other):
        finish(worker, [now - 2.0 + 0.5 * i for i in range(5)])  # 2 requests a second
    doc = list(range(1000, 1112))
    trees.record(WorkerType.COLOCATED, holder.url, doc[:96])
    policy = PromptTree(trees, Thresholds(), CostModel())
    report = {"num_waiting_reqs": 1, "num_pending_tokens": 112}  # not yet scheduled
    with holder.request(112):  # the client's previous request, reported while it ran
        holder.ask_load()
        holder.apply_load(report)
        assert policy.select(RouteRequest(doc, "", None), [holder, other]).reason == "overload"
    decision = policy.select(RouteRequest(doc, "", None), [holder, other])
    assert (decision.worker, decision.reason) == (holder, "cache_hit")
