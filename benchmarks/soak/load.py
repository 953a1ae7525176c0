"""The soak's load: sessions' turns, bad requests and abandoned streams as open-loop Poisson
arrivals for a fixed time (`benchmarks.load`), one record per request.

A busy session is skipped and a new one started, so a slow cluster shows as growing latency
and queues, not as a lower offered rate; a session whose turn failed ends there.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from benchmarks.load.bodies import body
from benchmarks.load.open_loop import poisson
from benchmarks.load.record import Record
from benchmarks.load.send import http_session, send
from benchmarks.soak.workload import BAD_BODIES, Mix, Session, Sessions

REQUEST_TIMEOUT_S = 120.0


@dataclass
class LoadResult:
    records: list[Record]
    offered: int
    sessions: int
    elapsed_s: float  # from the first arrival to the last answer


async def run_load(
    url: str,
    rps: float,
    duration_s: float,
    seed: int,
    on_record: Callable[[Record], None],
    mix: Mix | None = None,
    origin: float | None = None,
) -> LoadResult:
    """Poisson arrivals at `rps` for `duration_s` from `origin` (a time.perf_counter() value;
    default now), then wait for every answer."""
    mix = mix or Mix()
    rng = random.Random(seed)
    sessions = Sessions(mix, random.Random(seed + 1))
    records: list[Record] = []
    async with http_session(REQUEST_TIMEOUT_S) as http:

        async def turn(session: Session, record: Record, data: bytes) -> None:
            try:
                await send(http, url, data, record)
                if record.ok:
                    session.answered(record.answer)
                else:  # no answer to build on: the session ends here
                    session.turns_left = 0
            finally:
                session.busy = False
                on_record(record)

        async def bad(record: Record) -> None:
            record.path, data = rng.choice(BAD_BODIES)
            try:
                await send(http, url, data, record)
            finally:
                on_record(record)

        def arrive(t: float) -> Coroutine[Any, Any, None]:
            if rng.random() < mix.bad_share:
                record = Record(kind="bad", sent_s=t)
                records.append(record)
                return bad(record)
            session = sessions.next()
            session.ask(rng)
            session.busy = True
            stream = rng.random() < mix.stream_share
            abandon = stream and rng.random() < mix.abandon_share
            kind = "abandon" if abandon else "normal"
            record = Record(0, session.id, session.turn, session.api, stream, kind, sent_s=t)
            data = body(session.api, session.prompt(), rng.randint(*mix.max_tokens), stream=stream)
            records.append(record)
            return turn(session, record, data)

        elapsed = await poisson(rps, duration_s, rng, arrive, origin)
    return LoadResult(records, len(records), sessions.started, elapsed)
