"""Deadlines of the exchanges in flight with workers, checked by one timer per event loop.

An `asyncio.timeout_at` per exchange arms a loop timer and cancels it when the exchange
ends: two or three a request, which at max load cost about 4% of the router's CPU (uvloop
allocates and frees a libuv timer each time). Request timeouts are seconds to minutes long
(sglang-router's --request-timeout-secs), so one timer that wakes every TICK_S while any
exchange is in flight and expires the overdue ones does the same job: an exchange is ended
at most TICK_S after its deadline, as an `asyncio.Timeout` that expired (TimeoutError).
"""

from __future__ import annotations

import asyncio
import weakref

TICK_S = 0.05


class Deadlines:
    """The `asyncio.Timeout`s (entered without a deadline of their own) of one event loop's
    exchanges in flight, with their deadlines (loop time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[asyncio.Timeout, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, cm: asyncio.Timeout, deadline: float) -> None:
        """Expire `cm` (entered, with no deadline) once `deadline` has passed."""
        self._due[cm] = deadline
        if self._timer is None:
            self._timer = self._loop.call_later(TICK_S, self._expire_overdue)

    def discard(self, cm: asyncio.Timeout) -> None:
        self._due.pop(cm, None)

    def __len__(self) -> int:
        return len(self._due)

    @property
    def armed(self) -> bool:
        """Whether its timer runs (only while some exchange is, or just was, in flight)."""
        return self._timer is not None

    def _expire_overdue(self) -> None:
        now = self._loop.time()
        overdue = [cm for cm, deadline in self._due.items() if deadline <= now]
        for cm in overdue:
            del self._due[cm]
            if not cm.expired():  # (its worker's failed health checks may have ended it)
                cm.reschedule(now)
        self._timer = self._loop.call_later(TICK_S, self._expire_overdue) if self._due else None


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = (
    weakref.WeakKeyDictionary()
)


_last: Deadlines | None = None  # the last one asked for: a router runs one loop


def deadlines() -> Deadlines:
    """The running event loop's deadlines."""
    global _last
    loop = asyncio.get_running_loop()
    if _last is not None and _last._loop is loop:
        return _last
    found = _BY_LOOP.get(loop)
    if found is None:
        found = _BY_LOOP[loop] = Deadlines(loop)
    _last = found
    return found
