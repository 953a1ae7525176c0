"""Admission: how many requests the router lets in at once, how fast, and how far behind
the workers may be.

sglang-router's limits with its flag names: `--max-concurrent-requests` (0: unlimited) caps
requests inside the router, `--rate-limit-tokens-per-second` refills a token bucket that every
request takes one token from (burst: the bucket holds a second's worth, at least one). A
request that cannot go in at once waits in a queue of `--queue-size` for at most
`--queue-timeout-secs`; a full queue or a wait that runs out is a 429 with Retry-After, never
a hang.

Ours, `--max-expected-wait-secs` (0: off; router.wait_gate): while every eligible worker's
expected wait is past that deadline, a request waits in the same queue, and goes in when one
is within it. Holding is the default; a request is refused at once instead when its wait
past the deadline is longer than it may wait in the queue (it would time out anyway), and
`--queue-size 0` refuses every request that would wait. Such a 429's Retry-After is the
smallest expected wait minus the deadline, rounded up (at least 1 s); a full queue's or a
queue wait's also counts the requests queued ahead, at the rate the workers finish
requests, so that refused clients do not all come back while the queue is still full.
With tenants (router.tenants.fair), the queue is ordered by each tenant's computed tokens
per unit of its share rather than first in, first out.
The router admits a request once its body is read and before it is tokenized or sent to a
worker: from
admission to the worker's in-flight count nothing waits, so a burst cannot all pass on the
same stale load.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.wait_gate import TooLate, WaitGate

if TYPE_CHECKING:
    from router.tenants.fair import FairQueue

# why a request waited in the queue, and why one was refused (metric labels)
HOLD_REASONS = ("expected_wait", "concurrency", "rate_limit", "queued_ahead")
REFUSAL_REASONS = ("queue_full", "queue_timeout", "expected_wait")


class Refused(Exception):
    """The request cannot be admitted now: answered 429 with the message and Retry-After."""

    def __init__(self, message: str, reason: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.reason = reason  # one of REFUSAL_REASONS
        self.retry_after_s = retry_after_s


def retry_after(excess_s: float) -> int:
    """Whole seconds (at least 1) a client should wait: the wait past the deadline, rounded
    up."""
    return max(1, math.ceil(excess_s)) if math.isfinite(excess_s) else 1


@dataclass(slots=True)
class Limits:
    max_concurrent: int = 0  # 0: unlimited
    rate_per_s: float = 0.0  # requests a second; 0: unlimited
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    max_expected_wait_s: float = 0.0  # 0: off


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
    """The gate every inference request passes: `async with admission.slot(): ...`.

    `smallest_wait` (needed with a deadline): the smallest expected wait, in seconds, among
    the workers a request may go to, or None when none is available. The owner calls
    `load_changed` whenever a worker's load changes, so held requests look again.
    """

    def __init__(
        self,
        limits: Limits,
        smallest_wait: Callable[[], float | None] | None = None,
        drain_rate: Callable[[], float | None] | None = None,
    ) -> None:
        self.limits = limits
        # requests a second the eligible workers finish (None: not known yet)
        self.drain_rate = drain_rate or (lambda: None)
        self._slots = (
            asyncio.Semaphore(limits.max_concurrent) if limits.max_concurrent > 0 else None
        )
        self._bucket = (
            TokenBucket(limits.rate_per_s, max(limits.rate_per_s, 1.0))
            if limits.rate_per_s > 0
            else None
        )
        self.fair: FairQueue | None = None  # with tenants: the queue's order by tenant
        self.gate: WaitGate | None = None
        if limits.max_expected_wait_s > 0:
            if smallest_wait is None:
                raise ValueError("a deadline on the expected wait needs smallest_wait")
            self.gate = WaitGate(limits.max_expected_wait_s, smallest_wait)
        self.queued = 0
        self.holds = dict.fromkeys(HOLD_REASONS, 0)
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)

    def slot(self, tenant: str | None = None) -> _Slot:
        """Hold one admitted request's place while the block runs (`async with`); Refused
        when it cannot go in within the queue's limits. `tenant`: whose request (its place
        in a fair queue)."""
        return _Slot(self, tenant)

    async def _enter(self, tenant: str | None) -> None:
        fair = self.fair if tenant is not None else None
        if fair is not None and tenant is not None:
            fair.arrive(tenant)
        try:
            reason = self._hold_reason()
            if reason is not None:
                await self._queue(reason, tenant)
            elif self._bucket is not None or self._slots is not None:
                await self._wait_turn()  # free at once: nothing waits
        except BaseException:
            if fair is not None and tenant is not None:
                fair.leave(tenant)
            raise

    def _exit(self, tenant: str | None) -> None:
        if self.fair is not None and tenant is not None:
            self.fair.leave(tenant)
        if self._slots is not None:
            self._slots.release()
        # it ended (or failed before reaching a worker): whoever is held looks again
        self.load_changed()

    def load_changed(self) -> None:
        if self.gate is not None:
            self.gate.load_changed()

    def short_of_slots(self) -> bool:
        """Whether requests wait in the queue while every concurrency slot is taken: the
        router's limit holds them, not the workers' (a rate limit or the expected-wait gate
        may hold them too; either way no slot is free)."""
        return self.queued > 0 and self._slots is not None and self._slots.locked()

    def excess(self) -> float:
        """Seconds the least-waiting eligible worker is past the deadline (-inf without
        one)."""
        return -math.inf if self.gate is None else self.gate.excess()

    def _hold_reason(self) -> str | None:
        """Why this request must wait in the queue; None: it goes in at once."""
        if self.queued > 0:
            return "queued_ahead"  # first in, first out
        if self.gate is not None and self.gate.excess() > 0:
            return "expected_wait"
        if self._slots is not None and self._slots.locked():
            return "concurrency"
        if self._bucket is not None and self._bucket.available() < 1:
            return "rate_limit"
        return None

    async def _queue(self, reason: str, tenant: str | None) -> None:
        """Wait in the queue for the gate, a token and a slot, or raise Refused."""
        limits = self.limits
        excess = self.excess()
        if excess > limits.queue_timeout_s:
            raise self._refuse("expected_wait", excess)
        if self.queued >= limits.queue_size:
            raise self._refuse("queue_full", excess)
        self.holds[reason] += 1
        self.queued += 1
        give_up_at = asyncio.get_running_loop().time() + limits.queue_timeout_s
        fair = self.fair if tenant is not None else None
        head = False
        try:
            async with asyncio.timeout_at(give_up_at):
                if fair is not None and tenant is not None:
                    await fair.turn(tenant)
                    head = True
                if self.gate is not None:
                    await self.gate.admit(give_up_at)
                await self._wait_turn()
        except TooLate as exc:
            raise self._refuse("expected_wait", exc.excess_s) from None
        except TimeoutError:
            raise self._refuse("queue_timeout", self.excess()) from None
        finally:
            self.queued -= 1
            if head and fair is not None:
                fair.next()

    def _refuse(self, reason: str, excess_s: float) -> Refused:
        """Count a refusal; its Retry-After comes from the wait past the deadline and, for a
        full queue or a queue wait, the time the requests queued ahead take to drain."""
        self.refusals[reason] += 1
        wait_s = max(excess_s, 0.0)
        rate = self.drain_rate()
        if reason != "expected_wait" and rate:
            wait_s += (self.queued + 1) / rate
        if reason == "queue_full":
            message = "the router's queue is full; retry later"
        elif reason == "queue_timeout":
            message = "timed out waiting in the router's queue; retry later"
        else:
            assert self.gate is not None
            message = (
                f"every worker's expected wait ({excess_s + self.gate.deadline_s:.2f} s at "
                f"the least) is past --max-expected-wait-secs ({self.gate.deadline_s:g} s) "
                "for longer than a request may wait in the router's queue; retry later"
            )
        return Refused(message, reason, retry_after(wait_s))

    async def _wait_turn(self) -> None:
        """A token from the bucket, then a concurrency slot."""
        if self._bucket is not None:
            while (delay := self._bucket.take()) > 0:
                await asyncio.sleep(delay)
        if self._slots is not None:
            await self._slots.acquire()


class _Slot:
    """`Admission.slot()`'s context: a class, not a generator (every request enters one)."""

    __slots__ = ("_admission", "_tenant")

    def __init__(self, admission: Admission, tenant: str | None) -> None:
        self._admission = admission
        self._tenant = tenant

    async def __aenter__(self) -> None:
        await self._admission._enter(self._tenant)

    async def __aexit__(self, *exc: object) -> None:
        self._admission._exit(self._tenant)
