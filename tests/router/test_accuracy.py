"""The router watches its own accuracy (router.accuracy): per worker, the cached tokens it
predicted against those the worker reported, as counters and a gauge, and one warning when
workers reuse prefixes the router did not foresee.

The watch on a fake clock with a one-second window; then real sim workers and routers over
loopback for the counters, with one process and with two (summed over processes)."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.accuracy import ALL, AccuracyWatch
from router.forward.feedback import Learner, Served
from router.forward.relay import Outcome
from router.metrics import RouterMetrics
from router.policies import RouteRequest
from router.trees import PromptTrees
from router.workers import BreakerConfig, WorkerRegistry, WorkerType
from tests.http_client import call, metric
from tests.procs import Server
from tests.router.test_processes import converse_over_processes, each_process
from tests.router.test_router import router, sim_worker

A, B = "http://127.0.0.1:9301", "http://127.0.0.1:9302"
WINDOW = 1.0
MINIMUM = 1000
WARNING = "lost its view"
PER_WORKER = (
    "memserve_router_worker_predicted_cached_tokens",
    "memserve_router_worker_reported_cached_tokens",
    "memserve_router_worker_predicted_hit_tokens",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def watch(clock: Clock) -> AccuracyWatch:
    return AccuracyWatch(window_s=WINDOW, min_ratio=0.1, min_reported=MINIMUM, clock=clock)


def answers(clock: Clock, seconds: float, observe: Callable[[], None], every: float = 0.05) -> None:
    """`observe()` every `every` seconds for `seconds` of the fake clock."""
    for _ in range(round(seconds / every)):
        observe()
        clock.now += every


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "router.accuracy" and r.levelno == logging.WARNING and WARNING in r.message
    ]


# ----------------------------------------------------------------- the watch


def test_reported_hits_not_foreseen_warn_once_a_window(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    # 20 answers a second, each 64 cached tokens the router did not predict
    answers(clock, 1.5 * WINDOW, lambda: watch.observe(A, 0, 64))
    (record,) = warnings(caplog)  # one warning, not one per answer
    text = record.getMessage()
    assert A in text and "foresaw 0.0%" in text and "last 1 s" in text, text
    assert "tokenize" in text and "--tree-ttl-secs" in text, text
    answers(clock, WINDOW, lambda: watch.observe(A, 0, 64))
    assert len(warnings(caplog)) == 2  # still blind a window later: once more
    assert watch.warnings == 2
    assert watch.accuracy() == {A: 0.0, ALL: 0.0}


def test_foreseen_hits_do_not_warn(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    answers(clock, 3 * WINDOW, lambda: watch.observe(A, 64, 64))
    # predicting more than was reported (an eviction) is not blindness either
    answers(clock, 3 * WINDOW, lambda: watch.observe(A, 128, 64))
    assert warnings(caplog) == [] and watch.warnings == 0
    assert watch.accuracy() == {A: 1.0, ALL: 1.0}


def test_nothing_reported_does_not_warn_and_has_no_accuracy(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    answers(clock, 3 * WINDOW, lambda: watch.observe(A, 64, 0))
    answers(clock, 3 * WINDOW, lambda: watch.observe(B, 0, 0))
    assert warnings(caplog) == []
    assert watch.accuracy() == {}


def test_a_few_unforeseen_hits_below_the_minimum_do_not_warn(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Under `min_reported` cached tokens a window (here 40 answers of 20: 800 a window)."""
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    answers(clock, 4 * WINDOW, lambda: watch.observe(A, 0, 20), every=0.05)
    assert warnings(caplog) == []
    assert watch.accuracy()[ALL] == 0.0


@pytest.mark.parametrize(("predicted", "warned"), [(6, True), (7, False)])
def test_the_warning_is_under_a_tenth_foreseen(
    watch: AccuracyWatch,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
    predicted: int,
    warned: bool,
) -> None:
    """6 of 64 is 9.4%, 7 of 64 is 10.9%."""
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    answers(clock, 2 * WINDOW, lambda: watch.observe(A, predicted, 64))
    assert bool(warnings(caplog)) is warned
    assert math.isclose(watch.accuracy()[A], predicted / 64)


def test_the_warning_names_the_workers_most_affected_first(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.accuracy")

    def both() -> None:
        watch.observe(B, 50, 50)  # foreseen
        watch.observe(A, 0, 1000)  # blind

    answers(clock, 1.5 * WINDOW, both)
    (record,) = warnings(caplog)
    text = record.getMessage()
    assert text.index(A) < text.index(B), text
    assert f"{A} (0% of " in text and f"{B} (100% of " in text, text
    assert "foresaw 4.8%" in text, text  # 50 of 1,050


def test_the_window_slides(watch: AccuracyWatch, clock: Clock) -> None:
    answers(clock, WINDOW, lambda: watch.observe(A, 0, 64))
    answers(clock, 2 * WINDOW, lambda: watch.observe(A, 64, 64))
    assert watch.accuracy() == {A: 1.0, ALL: 1.0}  # the blind second has left the window
    clock.now += 2 * WINDOW
    assert watch.accuracy() == {}  # nothing reported lately: absent
    total = watch.totals[A]  # the counters' totals keep everything
    assert (total.predicted, total.reported, total.foreseen) == (40 * 64, 60 * 64, 40 * 64)


def test_a_router_blind_from_its_first_answer_warns_after_one_window(
    watch: AccuracyWatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The first seconds alone say little (a router restarted in front of warm workers):
    the first check comes once the watch has seen a whole window."""
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    answers(clock, 0.9 * WINDOW, lambda: watch.observe(A, 0, 640))
    assert warnings(caplog) == []
    answers(clock, 0.3 * WINDOW, lambda: watch.observe(A, 0, 640))
    assert len(warnings(caplog)) == 1


# ----------------------------------------------------------------- learning and metrics


def metrics_text(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def samples(text: str, name: str) -> dict[str, float]:
    """A metric's samples by their `worker` label, from Prometheus text."""
    return {
        s.labels["worker"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_learning_feeds_the_watch_and_the_per_worker_counters(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Every answer a worker reported cached tokens for, through Learner.learn."""
    caplog.set_level(logging.WARNING, logger="router.accuracy")
    registry = WorkerRegistry(BreakerConfig())
    a, b = registry.add(A), registry.add(B)
    trees = PromptTrees(page_size=16)
    watch = AccuracyWatch(window_s=WINDOW, min_reported=MINIMUM, clock=clock)
    metrics = RouterMetrics(registry, trees, watch)
    learner = Learner(trees, registry, metrics, None, True, lambda: True)
    answer = Outcome(status=200, output_ids=[1, 2, 3], completion_tokens=3)
    c = WorkerType.COLOCATED

    def one() -> None:
        prompt = RouteRequest(list(range(200)), "", None)
        # a PD-like pair: `a` reported 192 cached tokens where 16 were predicted, `b` nothing
        served = [Served(a, c, 16, 192), Served(b, c, 192, None)]
        learner.learn("/generate", prompt, answer, served, [(c, a)])

    answers(clock, 1.5 * WINDOW, one, every=0.1)  # 15 answers
    (record,) = warnings(caplog)  # 16 of 192 foreseen: 8.3%
    assert "foresaw 8.3%" in record.getMessage()
    text = metrics_text(metrics)
    assert samples(text, PER_WORKER[0] + "_total") == {A: 15 * 16}
    assert samples(text, PER_WORKER[1] + "_total") == {A: 15 * 192}
    assert samples(text, PER_WORKER[2] + "_total") == {A: 15 * 16}
    accuracy = samples(text, "memserve_router_prediction_accuracy")
    assert accuracy.keys() == {A, ALL} and math.isclose(accuracy[A], 16 / 192)
    # the router-wide totals count the same answers
    assert (trees.stats.predicted_tokens, trees.stats.reported_tokens) == (15 * 16, 15 * 192)


def test_answers_of_policies_without_tokens_are_not_watched(clock: Clock) -> None:
    """round_robin and the like predict nothing: no feedback, nothing counted."""
    registry = WorkerRegistry(BreakerConfig())
    a = registry.add(A)
    trees = PromptTrees(page_size=16)
    watch = AccuracyWatch(window_s=WINDOW, min_reported=MINIMUM, clock=clock)
    learner = Learner(trees, registry, RouterMetrics(registry, trees, watch), None, False, bool)
    c = WorkerType.COLOCATED
    prompt = RouteRequest(list(range(200)), "", None)
    answer = Outcome(status=200, output_ids=[1], completion_tokens=1)
    learner.learn("/generate", prompt, answer, [Served(a, c, 0, 192)], [(c, a)])
    assert watch.totals == {} and watch.accuracy() == {}


def test_an_empty_router_exports_the_families_without_samples() -> None:
    registry = WorkerRegistry(BreakerConfig())
    registry.add(A)
    text = metrics_text(RouterMetrics(registry, PromptTrees()))
    for name in (*PER_WORKER, "memserve_router_prediction_accuracy"):
        assert re.search(rf"^# TYPE {name}(_total)? ", text, re.M), name
        assert samples(text, name + "_total") == samples(text, name) == {}, name


# ----------------------------------------------------------------- real routers

PROMPTS = (list(range(1000, 1200)), list(range(5000, 5200)))  # 200 tokens: 12 whole pages
CACHED = 192


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Per-worker counters and the accuracy gauge by worker, from the router's /metrics."""
    text = call(url + "/metrics")[1]
    out = {name: samples(text, name + "_total") for name in PER_WORKER}
    out["accuracy"] = samples(text, "memserve_router_prediction_accuracy")
    out["router"] = {
        name: metric(text, name + "_total")
        for name in (
            "memserve_router_predicted_cached_tokens",
            "memserve_router_reported_cached_tokens",
        )
    }
    return out


def wait_for(condition: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """`condition()` once it is truthy (answers teach the router a moment after they land)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)
    return value


def generate(url: str, tokens: list[int]) -> int:
    status, body = call(
        url + "/generate", {"input_ids": tokens, "sampling_params": {"max_new_tokens": 4}}
    )
    assert status == 200, body
    return int(body["meta_info"]["cached_tokens"])


@contextlib.contextmanager
def two_workers(model_dir: Path, log_dir: Path) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(sim_worker(model_dir, log_dir)) for _ in range(2)]


def test_each_worker_counts_what_was_predicted_and_reported_for_it(
    model_dir: Path, tmp_path: Path
) -> None:
    with (
        two_workers(model_dir, tmp_path) as workers,
        router([w.url for w in workers], tmp_path) as r,
    ):
        urls = {w.url for w in workers}
        # Prompt 0 twice: its holder reported (and was predicted) 192 cached tokens.
        assert [generate(r.url, PROMPTS[0]) for _ in range(2)] == [0, CACHED]
        seen = wait_for(
            lambda: (
                (m := scrape(r.url))["router"]["memserve_router_reported_cached_tokens"] == CACHED
                and m
            )
        )
        reported = seen[PER_WORKER[1]]
        (holder,) = [u for u, n in reported.items() if n == CACHED]
        assert reported.keys() <= urls  # labelled by worker URL
        # the first answer (0 cached, 0 predicted) counts as reported too
        for name in PER_WORKER:
            assert seen[name][holder] == CACHED, (name, seen)
        assert seen["accuracy"][holder] == 1.0 and seen["accuracy"]["all"] == 1.0

        # Prompt 1 twice, wherever it goes: every counter adds up to the router-wide totals.
        assert [generate(r.url, PROMPTS[1]) for _ in range(2)] == [0, CACHED]
        seen = wait_for(
            lambda: (
                (m := scrape(r.url))["router"]["memserve_router_reported_cached_tokens"]
                == 2 * CACHED
                and m
            )
        )
        for name in PER_WORKER:
            assert sum(seen[name].values()) == 2 * CACHED, (name, seen)
        assert seen["router"]["memserve_router_predicted_cached_tokens"] == 2 * CACHED

        # The holder of prompt 0 evicts it behind the router's back: predicted, not reported,
        # for that worker alone.
        other = {u: seen[PER_WORKER[0]].get(u, 0.0) for u in urls - {holder}}
        before = {name: seen[name][holder] for name in PER_WORKER}
        assert call(holder + "/flush_cache", method="POST", raw=b"")[0] == 200
        assert generate(r.url, PROMPTS[0]) == 0
        after = wait_for(
            lambda: (
                (m := scrape(r.url))["router"]["memserve_router_predicted_cached_tokens"]
                == 3 * CACHED
                and m
            )
        )
        assert after[PER_WORKER[0]][holder] == before[PER_WORKER[0]] + CACHED
        assert after[PER_WORKER[1]][holder] == before[PER_WORKER[1]]
        assert after[PER_WORKER[2]][holder] == before[PER_WORKER[2]]
        assert {u: after[PER_WORKER[0]].get(u, 0.0) for u in other} == other


def test_per_worker_counters_add_up_over_processes(model_dir: Path, tmp_path: Path) -> None:
    """--processes 2: a conversation whose turns reach both processes is counted once, in
    full, by whichever process answers /metrics."""
    with (
        two_workers(model_dir, tmp_path) as workers,
        router([w.url for w in workers], tmp_path, "--processes", "2") as r,
    ):
        cached = sum(converse_over_processes(r))
        assert cached > 0
        info = each_process(r)
        assert all(i["process"]["inference_requests"] > 0 for i in info.values()), info

        def summed() -> dict[int, Any] | None:
            pages = each_process(r, "/metrics")
            totals = {
                i: {name: sum(samples(text, name + "_total").values()) for name in PER_WORKER}
                for i, text in pages.items()
            }
            reported = PER_WORKER[1]
            return totals if all(t[reported] == cached for t in totals.values()) else None

        totals = wait_for(summed)
        for t in totals.values():
            assert 0 < t[PER_WORKER[2]] <= t[PER_WORKER[1]], t  # foreseen: some, not more
