"""Closed loop: N clients, each sending its next request as soon as its last one is
answered, for a counted window after an uncounted warm-up: the most a server sustains."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Window:
    """What the counted window saw: requests completed in it."""

    latencies: list[float] = field(default_factory=list)  # of the answered ones, seconds
    errors: int = 0
    cpu_s: float | None = None  # what the caller's `cpu_s` counted over the window


async def closed_loop(
    one: Callable[[int], Awaitable[bool]],
    clients: int,
    warmup_s: float,
    duration_s: float,
    cpu_s: Callable[[], float] | None = None,
) -> Window:
    """`clients` loops calling `one(i)` (i counts requests across them; True: answered) over
    `warmup_s` uncounted then `duration_s` counted seconds; a request counts in the window
    it completes in."""
    counter = itertools.count()
    window = Window()
    start = time.perf_counter() + warmup_s
    end = start + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            ok = await one(next(counter))
            t1 = time.perf_counter()
            if start <= t1 <= end:
                if ok:
                    window.latencies.append(t1 - t0)
                else:
                    window.errors += 1

    async def cpu_in_window() -> None:
        if cpu_s is None:
            return
        await asyncio.sleep(start - time.perf_counter())
        before = cpu_s()
        await asyncio.sleep(end - time.perf_counter())
        window.cpu_s = cpu_s() - before

    await asyncio.gather(cpu_in_window(), *(client() for _ in range(clients)))
    return window
