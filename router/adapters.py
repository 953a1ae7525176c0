"""Which LoRA adapters each worker has loaded, as far as the router can tell, and what a
request for one costs there before its prefill.

An engine serves a request for an adapter it has not loaded by loading it first (SGLang:
`--max-loaded-loras` in memory, the least recently used evicted past that), which costs tens
of milliseconds to seconds by the adapter's size; past its limit it also evicts another
adapter, whose next request pays the load again. A router blind to adapters sends requests
for the same adapter to every worker in turn and pays a load on most of them (llm-d's LoRA
scorer prefers a worker with the adapter loaded, then one with a free slot). Here the price
joins the cost model (the decision's `before`: paid before the prefill, not learned), so a
worker holding the adapter and the request's prefix wins by both, and a busy one can still
lose to a free one.

An engine evicts only an adapter no running request uses: on a worker whose every slot holds
an adapter in use, a request for another one waits until one of them is done (SGLang's
scheduler leaves it in the queue). Under load that wait, a request's whole decode, dwarfs
the load itself; the router counts its own requests in flight per adapter and prices it.
The wait is that request's alone: the engine skips it for the requests behind it, which wait
only for the load itself, in the step that prefills it (`stall_s`).

What is known: the adapters a worker loaded at start (its server info: ours lists them with
their residency, SGLang's has `lora_paths` and `max_loaded_loras`), then every request the
router sends it, as the engine's LRU sees them. Requests from elsewhere and explicit
`/load_lora_adapter` calls are not seen until the worker is learned again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

HOLD_WEIGHT = 0.1  # the weight of the latest request in a worker's hold time (an average)


@dataclass(slots=True)
class WorkerAdapters:
    """One worker's adapters as the router sees them."""

    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    pinned: set[str] = field(default_factory=set)  # never evicted
    capacity: int | None = None  # its max_loaded_loras (None: not known)
    in_use: dict[str, int] = field(default_factory=dict)  # this router's requests in flight
    hold_s: float | None = None  # how long a request here has held its adapter, lately

    def has_room(self) -> bool:
        """Whether one more adapter loads here without evicting one (or the limit is not
        known)."""
        return self.capacity is None or len(self.resident) < self.capacity

    def seconds(self, adapter: str, load_s: float) -> float:
        """What a request for `adapter` pays here before its prefill: nothing if loaded, a
        load if a slot is free (or the limit is not known), two past the limit (the evicted
        adapter's next request loads it again); and where every adapter that could be
        evicted is in use, the wait for one to be done: of the `m` requests holding the
        least used one, the last to end, `m / (m + 1)` of a hold (their remaining times
        taken as uniform over one)."""
        if adapter in self.resident:
            return 0.0
        if self.has_room():
            return load_s
        using = [self.in_use.get(name, 0) for name in self.resident if name not in self.pinned]
        least = min(using, default=0)
        if least == 0 or self.hold_s is None:
            return 2 * load_s
        return 2 * load_s + self.hold_s * least / (least + 1)

    def paid_s(self, adapter: str, load_s: float) -> float:
        """Of `seconds`, what this request itself waits for: its load and, past the limit,
        the wait for an adapter to be done, but not the evicted adapter's next load, which a
        later request pays (the speed fit subtracts this part of a measured TTFT: the whole
        price fitted three of the LoRA preset's four equal workers' queues at 0.53-0.76x the
        constants within its first 40 requests; this part, 0.73-1.07x)."""
        seconds = self.seconds(adapter, load_s)
        if adapter in self.resident or self.has_room():
            return seconds
        return max(seconds - load_s, 0.0)

    def stall_s(self, adapter: str, load_s: float) -> float:
        """Of `seconds`, what the engine spends in the step that prefills the request, which
        every request queued here waits for too: its load, where `adapter` is not in memory
        (not a wait for a slot, while which the engine runs the others)."""
        return 0.0 if adapter in self.resident else load_s

    @contextmanager
    def serving(self, adapter: str) -> Iterator[None]:
        """Count one request for `adapter` in flight here while it runs, and learn from its
        time how long a request holds its adapter (from its sending to its end: a request
        answered whole tells no more; a failed one, which may end at once, tells nothing)."""
        self.in_use[adapter] = self.in_use.get(adapter, 0) + 1
        start = time.perf_counter()
        served = False
        try:
            yield
            served = True
        finally:
            left = self.in_use[adapter] - 1
            if left:
                self.in_use[adapter] = left
            else:
                del self.in_use[adapter]
            if served:
                held = time.perf_counter() - start
                last = self.hold_s
                self.hold_s = held if last is None else last + HOLD_WEIGHT * (held - last)

    def affinity(self, adapter: str) -> float:
        """llm-d's LoRA affinity score for `adapter` here: 1.0 loaded, 0.8 a free slot (or
        no known limit), 0 where a load must evict another. (llm-d's 0.6 for an adapter still
        loading is folded into 1.0: `sent` marks an adapter loaded with its first request.)"""
        if adapter in self.resident:
            return 1.0
        if self.has_room():
            return 0.8
        return 0.0

    def sent(self, adapter: str) -> None:
        """A request for `adapter` went here: loaded and most recently used, past the limit
        the least recently used unpinned ones evicted, those no request uses first (as the
        engine: it waits for one to be done)."""
        self.resident[adapter] = None
        self.resident.move_to_end(adapter)
        if self.capacity is None:
            return
        for idle_only in (True, False):
            for name in list(self.resident):
                if len(self.resident) <= self.capacity:
                    return
                if name == adapter or name in self.pinned:
                    continue
                if not idle_only or not self.in_use.get(name):
                    del self.resident[name]

    def as_json(self) -> dict[str, Any] | None:
        """What the router believes of this worker's adapters (GET /workers); None when it
        serves none that it knows of."""
        if not self.resident and self.capacity is None:
            return None
        return {
            "max_loaded_loras": self.capacity,
            "loaded": list(self.resident),  # least recently used first
            "pinned": sorted(self.pinned),
            "in_flight": dict(self.in_use),
            "hold_s": None if self.hold_s is None else round(self.hold_s, 4),
        }

    def learn(self, info: Mapping[str, Any]) -> None:
        """From a worker's /get_server_info: ours (`lora`: adapters with their residency) or
        SGLang's (`lora_paths` loaded at start, `max_loaded_loras`)."""
        ours = info.get("lora")
        if isinstance(ours, dict):
            self.capacity = _count(ours.get("max_loaded_loras"))
            adapters = [a for a in ours.get("adapters") or () if isinstance(a, dict)]
            loaded = [str(a.get("lora_name") or "") for a in adapters if a.get("resident")]
            self.pinned = {str(a.get("lora_name")) for a in adapters if a.get("pinned")}
        else:
            self.capacity = _count(info.get("max_loaded_loras"))
            loaded = _names(info.get("lora_paths"))
            self.pinned = set()
            if self.capacity is not None:
                loaded = loaded[: self.capacity]
        self.resident = OrderedDict((str(name), None) for name in loaded if name)


def _count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def _names(paths: Any) -> list[str]:
    """Adapter names of SGLang's --lora-paths as its server info gives them: a list of
    `NAME=PATH`, `PATH` or {lora_name, ...} entries, or a {name: path} mapping."""
    if isinstance(paths, dict):
        return [str(name) for name in paths]
    names = []
    for entry in paths if isinstance(paths, list) else ():
        if isinstance(entry, dict):
            names.append(str(entry.get("lora_name") or ""))
        elif isinstance(entry, str):
            names.append(entry.split("=", 1)[0])
    return names
