"""Exchange deadlines on one timer per loop: a worker that does not answer in time ends the
exchange with TimeoutError (at most a tick late), one that answers leaves nothing behind,
and its failed health checks still end it at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.deadlines import TICK_S, deadlines
from router.forward.relay import Bound
from router.workers import Worker


def test_an_exchange_past_its_deadline_ends_with_a_timeout_at_most_a_tick_late() -> None:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with Bound(loop.time() + 0.2, None):
                await asyncio.sleep(10)
        return time.monotonic() - started

    took = asyncio.run(run())
    assert 0.2 <= took < 0.2 + TICK_S + 0.2


def test_exchanges_that_finish_in_time_leave_no_deadline_and_no_timer() -> None:
    async def run() -> tuple[int, int, bool, bool]:
        loop = asyncio.get_running_loop()
        ends = []

        async def exchange(i: int) -> None:
            async with Bound(loop.time() + 5, None):
                await asyncio.sleep(0.01 * (i % 3))
                ends.append(i)

        await asyncio.gather(*(exchange(i) for i in range(50)))
        armed_after = deadlines().armed
        await asyncio.sleep(TICK_S * 3)  # the timer fires once more, finds none, stops
        return len(deadlines()), len(ends), armed_after, deadlines().armed

    left, ended, armed_after, armed_later = asyncio.run(run())
    assert (left, ended) == (0, 50)
    assert armed_after and not armed_later  # an idle router runs no timer


def test_a_worker_failing_its_health_checks_ends_its_exchanges_at_once() -> None:
    async def run() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        worker = Worker("http://127.0.0.1:1")

        async def exchange() -> None:
            async with Bound(loop.time() + 60, worker.exchanges):
                await asyncio.sleep(60)

        task = asyncio.ensure_future(exchange())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert worker.abandon_exchanges() == 1
        with pytest.raises(TimeoutError):
            await task
        return time.monotonic() - started, len(deadlines())

    took, left = asyncio.run(run())
    assert took < 0.5
    assert left == 0


def test_an_exchange_cancelled_from_outside_is_a_cancellation_not_a_timeout() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()

        async def exchange() -> None:
            async with Bound(loop.time() + 60, None):
                await asyncio.sleep(60)

        task = asyncio.ensure_future(exchange())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(deadlines()) == 0

    asyncio.run(run())
