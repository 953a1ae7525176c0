"""Fair admission by computed tokens: when requests wait in the router's admission queue,
the next one admitted is the waiting request of the tenant that has been charged the fewest
computed (not cached) prompt tokens per unit of its `share`.

This is start-time fair queueing over virtual time: each tenant's virtual time grows by the
tokens its requests compute divided by its share; the head of the queue goes to the waiting
tenant with the least, first in first out within a tenant. A request is charged when the
router decides where it goes (its prompt's tokens less the prefix predicted cached there,
what the worker is expected to compute), and once it answers, charged its prompt less the
cached tokens the worker reports instead (RouteRequest.charge_computed). A tenant that was
idle banks no credit: when it has a request again (none waiting nor admitted before) its
virtual time is brought up to the least among the active tenants, or a tenant back from a
quiet hour would take the cluster until it had caught up.

Only one waiting request at a time (the head) waits for the gate, a rate token and a slot,
so the order chosen here is the order admitted; requests that find the queue empty and the
router free go in at once, as without tenants.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class FairQueue:
    """The admission queue's order by tenant; `share(tenant)` is its weight (> 0)."""

    def __init__(self, share: Callable[[str], float]) -> None:
        self.share = share
        self.vtime: dict[str, float] = {}  # computed tokens / share, per tenant
        self.computed: dict[str, float] = {}  # computed tokens charged, per tenant
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._busy = False  # a request holds the head (waits for the gate, a token, a slot)
        self._active: dict[str, int] = {}  # requests waiting or admitted, per tenant

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` comes to admission. A tenant with none waiting nor admitted
        was idle: it banks no credit, its virtual time brought up to the least of the
        active tenants' (the time the queue has reached)."""
        active = self._active.get(tenant, 0)
        if not active and self._active:
            floor = min(self.vtime.get(t, 0.0) for t in self._active)
            if self.vtime.get(tenant, 0.0) < floor:
                self.vtime[tenant] = floor
        self._active[tenant] = active + 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` finished, or was refused."""
        left = self._active.get(tenant, 0) - 1
        if left > 0:
            self._active[tenant] = left
        else:
            self._active.pop(tenant, None)

    def charge(self, tenant: str, tokens: float) -> None:
        """`tenant`'s request computes `tokens` more (fewer, when negative: a correction)."""
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + tokens / self.share(tenant)
        self.computed[tenant] = self.computed.get(tenant, 0.0) + tokens

    def charger(self, tenant: str) -> Callable[[float], None]:
        """`charge` for one tenant's request (what the request carries to its decision)."""
        return lambda tokens: self.charge(tenant, tokens)

    async def turn(self, tenant: str) -> None:
        """Wait until this request of `tenant` is the head; the caller then calls `next`
        once it is admitted or gives up."""
        if not self._busy and not self._waiting:
            self._busy = True
            return
        queue = self._waiting.get(tenant)
        if queue is None:
            queue = self._waiting[tenant] = deque()
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.next()  # handed the head as it gave up: the next one takes it
            elif waiter in queue:
                queue.remove(waiter)
                if not queue and self._waiting.get(tenant) is queue:
                    del self._waiting[tenant]
            raise

    def next(self) -> None:
        """The head is done: the waiting tenant with the least virtual time goes next (the
        first to start waiting among equals); waiters that gave up are passed over."""
        while self._waiting:
            tenant = min(self._waiting, key=lambda t: self.vtime.get(t, 0.0))
            queue = self._waiting[tenant]
            waiter = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if not waiter.done():
                waiter.set_result(None)
                return
        self._busy = False
