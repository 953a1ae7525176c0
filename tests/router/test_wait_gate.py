"""Admission by expected wait, in process: the decision over real Worker objects and the
cost model, held requests woken by load changes (not by polling), refusals and their
Retry-After."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import pytest

from router.admission import Admission, Limits, Refused, retry_after
from router.forward.dispatch import Colocated, Sender
from router.pd import PDSettings, PrefillDecode
from router.policies import CostModel, RoundRobin
from router.workers import BreakerConfig, InFlight, WorkerRegistry, WorkerType
from shared.pd_caching import Caching

T = TypeVar("T")
# one second of expected wait per 1,000 queued prompt tokens; running requests cost nothing
COST = CostModel(prefill_s_per_token=1e-3, busy_s_per_request=0.0)


class Cluster:
    """Two workers, an admission gate over them, and a way to put work on each."""

    def __init__(self, deadline_s: float, **limits: float) -> None:
        self.registry = WorkerRegistry(BreakerConfig())
        self.a = self.registry.add("http://127.0.0.1:1001")
        self.b = self.registry.add("http://127.0.0.1:1002")
        self.looks = 0  # how often admission computed the expected wait
        self.admission = Admission(
            Limits(max_expected_wait_s=deadline_s, **limits),  # type: ignore[arg-type]
            self.smallest_wait,
        )
        self.registry.when_load_changes(self.admission.load_changed)

    def smallest_wait(self) -> float | None:
        self.looks += 1
        return min((COST.queue_s(w) for w in self.registry.available()), default=None)

    def work(
        self, seconds: float = 0.0, until: asyncio.Event | None = None
    ) -> Callable[[], Awaitable[None]]:
        """An admitted request's life, as the router's: sent to the worker with the least
        expected wait, with this much prefill work, in flight until `until` is set."""

        async def send() -> None:
            workers = self.registry.available()
            if not workers:
                return  # the dispatcher's 503
            with min(workers, key=COST.queue_s).request(round(seconds * 1000)):
                if until is not None:
                    await until.wait()

        return send

    def busy(self, seconds_a: float, seconds_b: float) -> tuple[InFlight, InFlight]:
        """Requests in flight with this much expected prefill work on each worker."""
        flights = (
            self.a.request(round(seconds_a * 1000)),
            self.b.request(round(seconds_b * 1000)),
        )
        for f in flights:
            f.__enter__()
        return flights


async def enter(
    admission: Admission,
    log: list[str],
    name: str,
    work: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Go through admission, note when it got in (then do its `work`) or why it was
    refused."""
    try:
        async with admission.slot():
            log.append(name)
            if work is not None:
                await work()
    except Refused as exc:
        log.append(f"{name}: {exc.reason} {exc.retry_after_s}")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 10))


def test_without_a_deadline_nothing_changes() -> None:
    async def scenario() -> tuple[list[str], dict[str, int]]:
        admission = Admission(Limits(queue_size=0), lambda: 1e9)  # workers far behind
        assert admission.gate is None
        log: list[str] = []
        await asyncio.gather(*(enter(admission, log, str(i)) for i in range(20)))
        return log, admission.holds

    log, holds = run(scenario)
    assert sorted(log, key=int) == [str(i) for i in range(20)]
    assert not any(holds.values())


def test_a_worker_within_the_deadline_admits_at_once() -> None:
    async def scenario() -> list[str]:
        c = Cluster(deadline_s=0.5, queue_size=0)  # no queue: anything held would be a 429
        c.busy(3.0, 0.4)  # a is far behind, b within the deadline
        log: list[str] = []
        await enter(c.admission, log, "r", c.work())
        return log

    assert run(scenario) == ["r"]


def test_held_while_every_worker_is_behind_then_admitted_in_order_when_load_drops() -> None:
    async def scenario() -> tuple[list[str], list[str], list[str], dict[str, int]]:
        c = Cluster(deadline_s=0.5, queue_timeout_s=5)
        (fa, fb) = c.busy(2.0, 1.5)
        log: list[str] = []
        release = asyncio.Event()
        tasks = [
            asyncio.create_task(enter(c.admission, log, f"r{i}", c.work(0.7 + i / 10, release)))
            for i in (1, 2, 3)
        ]
        await asyncio.sleep(0.1)
        held = list(log)
        # b finishes: the first in line goes in, and only it; its request lands on b with
        # 0.8 s of work, past the deadline again, so the next one stays
        fb.__exit__(None, None, None)
        await asyncio.sleep(0.05)
        after_b = list(log)
        # a finishes: the second goes in (0.9 s of work on a); the third is still behind
        fa.__exit__(None, None, None)
        await asyncio.sleep(0.05)
        after_a = list(log)
        release.set()  # both answered: the third goes in
        await asyncio.gather(*tasks)
        return held, after_b, after_a, c.admission.holds

    held, after_b, after_a, holds = run(scenario)
    assert held == []
    assert after_b == ["r1"]
    assert after_a == ["r1", "r2"]
    assert holds["expected_wait"] == 1 and holds["queued_ahead"] == 2


def test_held_requests_do_not_poll() -> None:
    async def scenario() -> tuple[int, int, list[str]]:
        c = Cluster(deadline_s=0.5, queue_timeout_s=5)
        (fa, _fb) = c.busy(1.0, 1.0)
        log: list[str] = []
        tasks = [asyncio.create_task(enter(c.admission, log, f"r{i}", c.work())) for i in range(5)]
        await asyncio.sleep(0.05)
        looks = c.looks
        await asyncio.sleep(0.4)  # nothing changes: nobody looks again
        idle_looks = c.looks - looks
        # a finishes: all five go in, one after another (each one's request, landing on a
        # and ending, wakes the next)
        fa.__exit__(None, None, None)
        await asyncio.gather(*tasks)
        return looks, idle_looks, log

    looks, idle_looks, log = run(scenario)
    assert idle_looks == 0
    assert looks <= 8  # each arrival looked once or twice, not in a loop
    assert log == [f"r{i}" for i in range(5)]


def test_a_full_queue_is_refused_with_retry_after_from_the_expected_wait() -> None:
    async def scenario() -> tuple[list[str], dict[str, int]]:
        c = Cluster(deadline_s=0.5, queue_size=2, queue_timeout_s=5)
        (fa, fb) = c.busy(3.0, 2.8)  # the least behind: 2.3 s past the deadline
        log: list[str] = []
        tasks = [asyncio.create_task(enter(c.admission, log, f"r{i}", c.work())) for i in range(4)]
        await asyncio.sleep(0.05)
        refused = list(log)
        fa.__exit__(None, None, None)
        fb.__exit__(None, None, None)
        await asyncio.gather(*tasks)
        return refused, c.admission.refusals

    refused, refusals = run(scenario)
    assert refused == ["r2: queue_full 3", "r3: queue_full 3"]
    assert refusals == {"queue_full": 2, "queue_timeout": 0, "expected_wait": 0}


def test_a_wait_that_cannot_be_made_up_in_time_is_refused_at_once() -> None:
    async def scenario() -> tuple[list[str], float, dict[str, int]]:
        c = Cluster(deadline_s=0.5, queue_timeout_s=2)
        c.busy(4.2, 5.0)  # 3.7 s past the deadline, more than the 2 s it may wait
        log: list[str] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        await enter(c.admission, log, "r")
        return log, loop.time() - started, c.admission.holds

    log, took, holds = run(scenario)
    assert log == ["r: expected_wait 4"]
    assert took < 0.1 and not any(holds.values())  # never held


def test_a_held_request_is_refused_once_its_wait_can_no_longer_be_made_up() -> None:
    async def scenario() -> tuple[list[str], float]:
        # 0.3 s past the deadline and 0.5 s to wait: refused after about 0.2 s
        c = Cluster(deadline_s=0.5, queue_timeout_s=0.5)
        c.busy(0.8, 0.9)
        log: list[str] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        await enter(c.admission, log, "r")
        return log, loop.time() - started

    log, took = run(scenario)
    assert log == ["r: expected_wait 1"]
    assert 0.15 <= took < 0.45


def test_the_next_in_line_looks_as_soon_as_the_first_gives_up() -> None:
    async def scenario() -> list[str]:
        c = Cluster(deadline_s=0.5, queue_timeout_s=0.3)
        c.busy(0.6, 0.6)  # 0.1 s past: the first waits 0.2 s before giving up
        log: list[str] = []
        first = asyncio.create_task(enter(c.admission, log, "r1"))
        await asyncio.sleep(0.15)
        await enter(c.admission, log, "r2")  # behind r1, then first in line with 0.15 s left
        await first
        return log

    assert run(scenario) == ["r1: expected_wait 1", "r2: expected_wait 1"]


def test_no_available_worker_admits_so_the_dispatcher_answers_503() -> None:
    async def scenario() -> list[str]:
        c = Cluster(deadline_s=0.5, queue_size=0)
        c.busy(3.0, 3.0)
        c.a.healthy = c.b.healthy = False
        log: list[str] = []
        await enter(c.admission, log, "r", c.work())
        return log

    assert run(scenario) == ["r"]


@pytest.mark.parametrize(
    ("excess", "seconds"), [(0.0001, 1), (0.99, 1), (1.0, 1), (1.01, 2), (7.5, 8), (math.inf, 1)]
)
def test_retry_after_is_the_wait_past_the_deadline_rounded_up(excess: float, seconds: int) -> None:
    assert retry_after(excess) == seconds


def test_the_workers_that_decide_are_the_ones_a_request_queues_at_first() -> None:
    registry = WorkerRegistry(BreakerConfig())
    colocated = registry.add("http://127.0.0.1:1001")
    prefill = registry.add("http://127.0.0.1:1002", WorkerType.PREFILL, 8998)
    registry.add("http://127.0.0.1:1003", WorkerType.DECODE)
    sender = cast(Sender, None)  # not sending anything
    assert Colocated(RoundRobin(), registry, sender).eligible() == [colocated]
    settings = PDSettings(Caching.parse("basic"), RoundRobin(), RoundRobin())
    assert PrefillDecode(settings, registry, sender).eligible() == [prefill]


def test_a_full_queues_retry_after_counts_the_requests_queued_ahead() -> None:
    """Refused clients told to come back in 1 s would all return while the queue is still
    full: the queue ahead drains at the rate the workers finish requests."""

    async def scenario() -> list[str]:
        admission = Admission(
            Limits(max_expected_wait_s=0.5, queue_size=4, queue_timeout_s=30),
            lambda: 1.5,  # 1 s past the deadline
            lambda: 2.0,  # the workers finish 2 requests a second
        )
        log: list[str] = []
        tasks = [asyncio.create_task(enter(admission, log, f"r{i}")) for i in range(6)]
        await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return log

    # 4 held; the 5th and 6th are refused: 1 s past the deadline + 5 requests / 2 per s
    assert run(scenario) == ["r4: queue_full 4", "r5: queue_full 4"]
