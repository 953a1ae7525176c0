"""Admission by expected wait: hold requests while every eligible worker is too far behind.

sglang-router admits by count; this router also knows how far behind each worker is (the
cost model's queue term: queued prefill tokens and running requests,
router.policies.CostModel.queue_s). With a deadline set, a request goes in only when some
worker the policy may choose for it is expected to start it within the deadline; until
then it is held, first in first out. Only the first in line looks: the decision is the same
for every request (it does not depend on the prompt), so when the first may not go in,
nobody behind it may. The first in line looks again when a worker's load changes (a request
sent, begun or finished, a load report, a worker back; `load_changed`), never by polling.

A request that goes in becomes load only when it is sent, a moment later; the next in line
is therefore not woken by that admission but by the load change its sending makes (or its
end, if it fails before), so a burst released at once cannot overshoot the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable


class TooLate(Exception):
    """The wait past the deadline is longer than the request may still wait."""

    def __init__(self, excess_s: float) -> None:
        super().__init__(f"{excess_s:.2f} s past the deadline")
        self.excess_s = excess_s


class WaitGate:
    """Lets requests in while some eligible worker's expected wait is within the deadline."""

    def __init__(self, deadline_s: float, smallest_wait: Callable[[], float | None]) -> None:
        self.deadline_s = deadline_s
        # the smallest expected wait among the workers a request may go to; None: none is
        # available (admitted: the dispatcher answers 503 at once)
        self.smallest_wait = smallest_wait
        self._held: deque[asyncio.Event] = deque()

    @property
    def held(self) -> int:
        return len(self._held)

    def excess(self) -> float:
        """Seconds the least-waiting eligible worker is past the deadline; <= 0 admits."""
        wait = self.smallest_wait()
        return -math.inf if wait is None else wait - self.deadline_s

    async def admit(self, give_up_at: float) -> None:
        """Return once this request is first in line and some worker's expected wait is
        within the deadline. TooLate as soon as the wait past the deadline is longer than
        the time left until `give_up_at` (the loop's clock): queues drain at about a second
        a second, so it would time out anyway."""
        loop = asyncio.get_running_loop()
        me = asyncio.Event()
        self._held.append(me)
        admitted = False
        try:
            while True:
                timeout: float | None = None  # behind another: woken when it leaves
                if self._held[0] is me:
                    excess = self.excess()
                    if excess <= 0:
                        admitted = True
                        return
                    left = give_up_at - loop.time()
                    if excess >= left:
                        raise TooLate(excess)
                    timeout = left - excess  # then the excess can no longer be made up
                me.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await me.wait()
        finally:
            first = self._held[0] is me
            self._held.remove(me)
            if first and not admitted and self._held:
                self._held[0].set()  # refused or gone: the next one decides now

    def load_changed(self) -> None:
        """A worker's load, or which workers are available, changed: the first in line
        looks again."""
        if self._held:
            self._held[0].set()
