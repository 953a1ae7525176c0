"""The queued floor: what queueing alone costs at a run's load, with a perfect router.

The floor (`floor.py`) runs every request alone. Under load a request also waits for the
ones before it, and no router removes that wait: it only chooses where to wait. The queued
floor charges it as the best a router could: one central first-come-first-served queue in
front of the prefill workers (colocated workers, or a PD cluster's prefills), each request
starting on the first worker to free up (late binding, perfect knowledge of every queue),
with the oracle's cache on every worker, for the floor's time (its own prefill alone). The
send times are the run's own, so it is the wait those very arrivals imply.

The same queue with the LRU reference's hits (`oracle.LruCaches`: the cluster's prefill caches
at their size, evicting as SGLang does, perfect locality) is the queued floor at the
cluster's caches (`lru_queue_floor_*`): what is left of the wait once the caches' size is
counted too.

In a run whose requests name LoRA adapters, the queue also pays the adapters' loads, placing
each request where it starts soonest counting its load (`adapter_floor`).

It is a reference, not a proof: an engine that batches a short prompt beside a long one's
chunk can answer the short one sooner than a FIFO queue would, so a system can beat it on
some requests; but a p99 well above it is lost to routing, to misses or to the engines, and a
p99 target the queued floor itself misses cannot be met by routing at that load.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from benchmarks.harness import percentile
from benchmarks.multiturn.adapter_floor import RunAdapters, adapter_fcfs_ttfts
from benchmarks.multiturn.floor import Floor

PREFILL_ROLES = ("colocated", "prefill")


def prefill_servers(roles: Sequence[str]) -> int:
    """The workers a run's prompts queue for: colocated ones, or a PD cluster's prefills."""
    return sum(role in PREFILL_ROLES for role in roles)


def fcfs_waits(arrivals: Sequence[float], services: Sequence[float], servers: int) -> list[float]:
    """Each job's wait in one FIFO queue before `servers` identical servers, in the order of
    `arrivals` (seconds); its service takes `services[i]`. ValueError without a server."""
    if servers < 1:
        raise ValueError(f"a queue needs at least one server, got {servers}")
    if len(arrivals) != len(services):
        raise ValueError(f"{len(arrivals)} arrivals but {len(services)} services")
    free_at = [0.0] * servers
    waits = [0.0] * len(arrivals)
    for i in sorted(range(len(arrivals)), key=lambda j: (arrivals[j], j)):
        start = max(arrivals[i], heapq.heappop(free_at))
        heapq.heappush(free_at, start + services[i])
        waits[i] = start - arrivals[i]
    return waits


def queued_floor_stats(
    floor: Floor,
    hits: Sequence[int | None],
    lengths: Sequence[int | None],
    sent: Sequence[float | None],
    measured: Sequence[int],
    servers: int,
    name: str = "queue_floor",
    adapters: RunAdapters | None = None,
) -> dict[str, float | None]:
    """`{name}_ttft_mean_s` and `_p99_s` over the requests `measured`: every request sent
    (warm-ups too: they hold a worker as long) queues, per rid, at `sent[rid]` for its floor
    TTFT (with `hits`, the oracle's or the LRU reference's, prompt lengths `lengths`); with
    `adapters`, on the workers' adapter slots (their loads paid in the queue)."""
    pairs = enumerate(zip(sent, lengths, strict=True))
    rids = [rid for rid, (at, n) in pairs if at is not None and n]
    services = [floor.ttft_s(lengths[rid] or 0, hits[rid] or 0) for rid in rids]
    arrivals = [sent[rid] or 0.0 for rid in rids]
    if adapters is None:
        waits = fcfs_waits(arrivals, services, servers)
        ttfts = [wait + service for wait, service in zip(waits, services, strict=True)]
    else:
        named = [adapters.named[rid] for rid in rids]
        ttfts = adapter_fcfs_ttfts(arrivals, services, named, adapters.slots())
    ttft = dict(zip(rids, ttfts, strict=True))
    mine = [ttft[rid] for rid in measured if rid in ttft]
    if not mine:
        return {f"{name}_ttft_mean_s": None, f"{name}_ttft_p99_s": None}
    return {
        f"{name}_ttft_mean_s": sum(mine) / len(mine),
        f"{name}_ttft_p99_s": percentile(mine, 0.99),
    }


def lru_reference(
    floor: Floor,
    lru_hits: Sequence[int | None],
    lengths: Sequence[int | None],
    sent: Sequence[float | None],
    measured: Sequence[int],
    servers: int,
    adapters: RunAdapters | None = None,
) -> dict[str, float | None]:
    """The LRU reference's hit ratio over `measured` (`lru_hit_ratio`) and the queued floor
    with its hits (`lru_queue_floor_ttft_mean_s` / `_p99_s`)."""
    prompt = sum(lengths[rid] or 0 for rid in measured)
    reused = sum(lru_hits[rid] or 0 for rid in measured)
    out: dict[str, float | None] = {"lru_hit_ratio": reused / prompt if prompt else None}
    queued = queued_floor_stats(
        floor, lru_hits, lengths, sent, measured, servers, "lru_queue_floor", adapters
    )
    out.update(queued)
    return out
