"""Admission: how many requests the router lets in at once, and how fast.

sglang-router's limits with its flag names: `--max-concurrent-requests` (0: unlimited) caps
requests inside the router, `--rate-limit-tokens-per-second` refills a token bucket that every
request takes one token from (burst: the bucket holds a second's worth, at least one). A
request that cannot go in at once waits in a queue of `--queue-size` for at most
`--queue-timeout-secs`; a full queue or a wait that runs out is a 429 with Retry-After, never
a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


class Refused(Exception):
    """The request cannot be admitted now; the message says why (answered as a 429)."""


@dataclass(slots=True)
class Limits:
    max_concurrent: int = 0  # 0: unlimited
    rate_per_s: float = 0.0  # requests a second; 0: unlimited
    queue_size: int = 100
    queue_timeout_s: float = 60.0


class TokenBucket:
    """`rate` tokens a second, holding at most `burst`."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self._at = clock()

    def available(self) -> float:
        """Tokens in the bucket now."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        return self.tokens

    def take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one will be (none
        taken)."""
        if self.available() >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Admission:
    """The gate every inference request passes: `async with admission.slot(): ...`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._slots = (
            asyncio.Semaphore(limits.max_concurrent) if limits.max_concurrent > 0 else None
        )
        self._bucket = (
            TokenBucket(limits.rate_per_s, max(limits.rate_per_s, 1.0))
            if limits.rate_per_s > 0
            else None
        )
        self.queued = 0
        self.refused = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one admitted request's place while the block runs; Refused when none frees
        within the queue's limits."""
        if self._must_wait():
            if self.queued >= self.limits.queue_size:
                self.refused += 1
                raise Refused("the router's queue is full; retry later")
            self.queued += 1
            try:
                async with asyncio.timeout(self.limits.queue_timeout_s):
                    await self._wait_turn()
            except TimeoutError:
                self.refused += 1
                raise Refused("timed out waiting in the router's queue") from None
            finally:
                self.queued -= 1
        else:
            await self._wait_turn()  # free at once: nothing waits
        try:
            yield
        finally:
            if self._slots is not None:
                self._slots.release()

    def _must_wait(self) -> bool:
        busy = self._slots is not None and self._slots.locked()
        empty = self._bucket is not None and self._bucket.available() < 1
        return busy or empty or self.queued > 0

    async def _wait_turn(self) -> None:
        """A token from the bucket, then a concurrency slot."""
        if self._bucket is not None:
            while (delay := self._bucket.take()) > 0:
                await asyncio.sleep(delay)
        if self._slots is not None:
            await self._slots.acquire()
