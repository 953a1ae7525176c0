"""Open loop: Poisson arrivals for a fixed time, none of which waits for an answer, so a slow
server shows as growing latency and queues, not as a lower offered rate."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any


async def poisson(
    rps: float,
    duration_s: float,
    rng: random.Random,
    arrive: Callable[[float], Coroutine[Any, Any, None]],
    origin: float | None = None,
) -> float:
    """Call `arrive(t)` at Poisson arrivals at `rps` for `duration_s` (t: seconds since
    `origin`, a time.perf_counter() value; default now) and run the coroutine it returns as a
    task of its own; `arrive` makes its choices before the next arrival is drawn, so one
    seeded `rng` gives the same load every time. Waits for every task; the seconds from
    `origin` to the last one's end."""
    start = time.perf_counter() if origin is None else origin
    tasks: set[asyncio.Task[None]] = set()
    arrival = 0.0
    while (arrival := arrival + rng.expovariate(rps)) < duration_s:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        task = asyncio.create_task(arrive(time.perf_counter() - start))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return time.perf_counter() - start
