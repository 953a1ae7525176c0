"""The floors of a LoRA run: what adapter loads cost before any routing choice.

The floor (`floor.py`) and the queued floor (`queue_floor.py`) price prefill alone. A
request for an adapter that no worker had loaded at the start, sent before any other request
named it, waits for a load wherever it goes: no router avoids that. So in a run whose
requests name adapters, each request's floor is its prefill alone plus, for such a first
request, one load (`Floor.lora_load_s`: the sim's latency model, times the time scale).

The queued floor of such a run places every request as a router with perfect knowledge
and late binding would: in the order sent, on the worker where it would start soonest
counting the load it pays there (none if the worker holds its adapter, else one; past
`--max-loaded-loras` the least recently used adapter gives way), its prefill then taking the
floor's time. A reference, not a proof, as the queued floor is: an engine that batches can
beat a FIFO queue on some requests, and a cleverer placement can save a later load by paying
one now. But a p99 limit below the floor counting the loads no router avoids cannot be met on
that seed by any router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from router.adapters import WorkerAdapters


@dataclass(frozen=True)
class RunAdapters:
    """A run's adapters: the one each request names (per rid; None: the base model), those
    each worker held at the start, the workers' `--max-loaded-loras` (None: no limit) and
    the wall seconds of one load."""

    named: Sequence[str | None]
    at_start: Sequence[Sequence[str]]
    capacity: int | None
    load_s: float

    def unavoidable_s(self, sent: Sequence[float | None]) -> list[float]:
        """Per rid, the load no router avoids (seconds; 0 for most): the request names an
        adapter that no worker held at the start, and no request sent before it did."""
        seen = {name for names in self.at_start for name in names}
        out = [0.0] * len(self.named)
        order = sorted((at, rid) for rid, at in enumerate(sent) if at is not None)
        for _, rid in order:
            adapter = self.named[rid]
            if adapter is not None and adapter not in seen:
                out[rid] = self.load_s
                seen.add(adapter)
        return out

    def slots(self) -> AdapterSlots:
        """The workers' adapter slots as they started (a fresh model each call)."""
        return AdapterSlots.at_start(self.at_start, self.capacity, self.load_s)


@dataclass
class AdapterSlots:
    """Each worker's loaded adapters in a modelled cluster, kept as the router keeps them
    (`router.adapters.WorkerAdapters`: least recently used evicted past `capacity`, None: no
    limit; no request holds one here); a load costs `load_s` seconds."""

    workers: list[WorkerAdapters]
    load_s: float

    @classmethod
    def at_start(
        cls, at_start: Sequence[Sequence[str]], capacity: int | None, load_s: float
    ) -> AdapterSlots:
        """ValueError without a worker or with a limit below 1."""
        if not at_start:
            raise ValueError("adapter slots need at least one worker")
        if capacity is not None and capacity < 1:
            raise ValueError(f"a worker holds at least one adapter, got a limit of {capacity}")
        workers = [
            WorkerAdapters(OrderedDict.fromkeys(names), capacity=capacity) for names in at_start
        ]
        return cls(workers, load_s)

    def cost_s(self, worker: int, adapter: str | None) -> float:
        """What a request for `adapter` pays on `worker` before its prefill."""
        held = adapter is None or adapter in self.workers[worker].resident
        return 0.0 if held else self.load_s

    def use(self, worker: int, adapter: str | None) -> None:
        """A request for `adapter` runs on `worker`: loaded there, most recently used, and
        past the limit the least recently used adapter evicted."""
        if adapter is not None:
            self.workers[worker].sent(adapter)


def adapter_fcfs_ttfts(
    arrivals: Sequence[float],
    services: Sequence[float],
    adapters: Sequence[str | None],
    slots: AdapterSlots,
) -> list[float]:
    """Each request's TTFT in one FIFO queue (by arrival) before the workers of `slots`:
    placed where it would start soonest with its adapter's load (the earliest worker on a
    tie), then its service. ValueError on lists of different lengths."""
    if not len(arrivals) == len(services) == len(adapters):
        raise ValueError(
            f"{len(arrivals)} arrivals, {len(services)} services, {len(adapters)} adapters"
        )
    free_at = [0.0] * len(slots.workers)
    ttfts = [0.0] * len(arrivals)
    for i in sorted(range(len(arrivals)), key=lambda j: (arrivals[j], j)):

        def ready(w: int, i: int = i) -> float:
            return max(arrivals[i], free_at[w]) + slots.cost_s(w, adapters[i])

        worker = min(range(len(free_at)), key=ready)
        free_at[worker] = ready(worker) + services[i]
        slots.use(worker, adapters[i])
        ttfts[i] = free_at[worker] - arrivals[i]
    return ttfts
