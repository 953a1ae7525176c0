"""The ramp's requests: sessions of Mooncake's conversation trace, rows sent independently,
open loop.

Each seed samples whole sessions of the trace (`benchmarks.multiturn.trace.TraceReplay`)
into a pool, the sessions in a seeded order. A step takes the pool's first sessions until
it has `rate x duration` rows and offers them with Poisson arrivals at `rate`, dealt to the
sessions in a random interleaving, each session's turns in order
(`benchmarks.multiturn.workloads.deal_arrivals`, as MemServe samples its arrivals): a later
turn follows its earlier turns by seconds, and shares their blocks. A trace row carries its
whole prompt (its hash ids), so no turn needs its parent's answer to be sent: open loop,
every row goes at its own time, whatever happened to the turns before it, so the offered
load is the load sent even past saturation (a worker caches a prompt once it is prefilled,
as SGLang does, so a turn sent while its previous one still decodes finds its prompt). A
refusal never removes a request: every system is offered exactly the same requests.

The SLO's base, each request's floor, is computed before anything is sent: its prefill
alone on one instance holding every earlier prompt of the step (the oracle's cache).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.oracle import PrefixOracle
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.trace import TraceReplay
from benchmarks.multiturn.workloads import Request, Workload, deal_arrivals

POOL_RATE = 1.0  # the pool's own timestamps are replaced by each step's arrivals


@dataclass(frozen=True)
class Pool:
    """One seed's sessions in a seeded order, each its rows in trace order (`rid` and `parent`
    are rows of the trace subset), not yet timed."""

    seed: int
    sessions: tuple[tuple[Request, ...], ...]
    params: dict[str, Any]

    def __len__(self) -> int:
        return sum(len(turns) for turns in self.sessions)

    def take(self, count: int) -> list[tuple[Request, ...]]:
        """The first sessions holding `count` rows (the last one cut short)."""
        out, left = [], count
        for turns in self.sessions:
            if left <= 0:
                break
            out.append(turns[:left])
            left -= len(out[-1])
        return out


def build_pool(
    trace: Path,
    vocab: Vocab,
    seed: int,
    sessions: int,
    max_input_tokens: int,
    max_output_tokens: int,
) -> Pool:
    replay = TraceReplay(
        trace,
        sessions=sessions,
        rate=POOL_RATE,
        max_input_tokens=max_input_tokens,
        max_output_tokens=max_output_tokens,
        seed=seed,
    )
    built = replay.build(vocab)
    grouped: dict[str, list[Request]] = {}
    for r in built.requests:  # trace order: each session's turns in order, rid the row's
        grouped.setdefault(r.session, []).append(replace(r, at_s=0.0))
    order = list(grouped)
    random.Random(f"overload-pool:{seed}").shuffle(order)
    params = {k: v for k, v in built.params.items() if k not in ("trace", "rate", "time_scale")}
    params["trace_file"] = Path(trace).name  # never the machine's path
    return Pool(seed, tuple(tuple(grouped[s]) for s in order), params)


def step_workload(pool: Pool, rate: float, count: int, label: str) -> Workload:
    """`count` rows of the pool's first sessions, Poisson arrivals at `rate` dealt to the
    sessions (seeded by the pool's seed and `label`: every system of a step gets the same
    requests at the same times); open loop, no row waits for another's answer."""
    if count > len(pool):
        raise ValueError(
            f"a step at {rate:.2f} req/s needs {count} requests; seed {pool.seed}'s pool "
            f"has {len(pool)} (sample more sessions)"
        )
    sessions = pool.take(count)
    rng = random.Random(f"overload:{pool.seed}:{label}")
    times = deal_arrivals(rng, [len(turns) for turns in sessions], rate)
    timed = [
        replace(r, at_s=t)
        for turns, at in zip(sessions, times, strict=True)
        for r, t in zip(turns, at, strict=True)
    ]
    timed.sort(key=lambda r: r.at_s)
    requests = [replace(r, rid=i, parent=None) for i, r in enumerate(timed)]
    params = {
        **pool.params,
        "rate": rate,
        "requests": count,
        "step_sessions": len(sessions),
        "seed": pool.seed,
        "arrivals": "open loop",
    }
    return Workload("trace", "Mooncake conversation trace, independent rows", requests, params)


def oracle_floors(requests: Sequence[Request], floor: Floor) -> list[float]:
    """Each request's TTFT alone with an infinite cache of every earlier prompt (in arrival
    order): the oracle's hit, then the latency model's prefill of the rest."""
    oracle = PrefixOracle()
    out = []
    for r in sorted(requests, key=lambda r: r.at_s):
        ids = r.prompt_ids or []
        out.append((r.rid, floor.ttft_s(len(ids), oracle.hit(ids))))
        oracle.add(ids)
    return [f for _, f in sorted(out)]


def mean_floor_s(workload: Workload, floor: Floor) -> float:
    """A workload's mean floor TTFT: what the deadline is a multiple of."""
    return statistics.fmean(oracle_floors(workload.requests, floor))
