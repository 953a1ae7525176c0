"""The soak's load: multi-turn sessions as open-loop Poisson arrivals (`benchmarks.load`).

A session keeps one API and one of a few shared system prompts (sessions share prefixes) and
resends its growing history each turn, capped to fit one worker's small device KV. A busy
session is skipped and a new one started, so a slow cluster shows as growing latency, not a
lower offered rate; a session whose turn failed ends there.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from benchmarks.load.bodies import CHAT, GENERATE, body
from benchmarks.load.open_loop import poisson
from benchmarks.load.record import Record
from benchmarks.load.send import http_session, send

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy process music market sense nation plan college interest "
    "death experience effect class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love "
    "support technology step baby computer type attention film tree source organization hair "
    "window evidence population river garden bridge cloud stone summer winter answer blue green"
)
WORDS = _WORDS.split()
SYSTEM_PROMPTS = 6  # shared system prompts: sessions reuse each other's prefixes
MAX_HISTORY_WORDS = 700  # about 1,000 tokens with the template: fits a 2,048-token device KV
REQUEST_TIMEOUT_S = 120.0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(index: int) -> str:
    rng = random.Random(f"system:{index}")
    return f"You are assistant number {index}. " + words(rng, rng.randint(60, 140)) + "."


@dataclass
class Session:
    """One conversation: its API, its history so far, how many turns it has left."""

    id: int
    api: str  # CHAT | GENERATE
    system: str
    turns_left: int
    messages: list[dict[str, str]] = field(default_factory=list)
    busy: bool = False  # a turn is in flight: the next one needs its answer
    turn: int = 0

    @property
    def done(self) -> bool:
        history = sum(len(m["content"].split()) for m in self.messages)
        return self.turns_left <= 0 or history > MAX_HISTORY_WORDS

    def ask(self, rng: random.Random) -> None:
        self.messages.append({"role": "user", "content": words(rng, rng.randint(15, 70))})

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.turns_left -= 1
        self.turn += 1

    def prompt(self) -> list[dict[str, str]] | str:
        """The chat, or for /generate the chat as plain text."""
        if self.api == CHAT:
            return [{"role": "system", "content": self.system}, *self.messages]
        turns = "".join(
            f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n"
            for m in self.messages
        )
        return f"{self.system}\n{turns}Assistant:"


@dataclass(frozen=True)
class Mix:
    """Shares of the request kinds (per arrival)."""

    chat_share: float = 0.6  # sessions on /v1/chat/completions, the rest on /generate
    stream_share: float = 0.5
    abandon_share: float = 0.05  # of streams: closed after the first chunk
    bad_share: float = 0.02  # malformed requests that must get a 400
    turns: tuple[int, int] = (2, 10)
    max_tokens: tuple[int, int] = (4, 32)
    active_sessions: int = 12  # a new session starts when fewer are idle-and-unfinished


BAD_BODIES: tuple[tuple[str, bytes], ...] = (
    (CHAT, b'{"messages": "not a list", "max_tokens": 4}'),
    (CHAT, b'{"messages": [{"role": "user"'),  # truncated JSON
    (GENERATE, b'{"sampling_params": {"max_new_tokens": 4}}'),  # neither text nor input_ids
    (CHAT, json.dumps({"messages": [], "max_tokens": 4}).encode()),
    (GENERATE, json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -5}}).encode()),
)


@dataclass
class Sessions:
    """Picks which session speaks at each arrival; starts new ones as old ones finish."""

    mix: Mix
    rng: random.Random
    active: list[Session] = field(default_factory=list)
    started: int = 0

    def next(self) -> Session:
        """An idle, unfinished session, or a new one when there are too few idle ones."""
        self.active = [s for s in self.active if s.busy or not s.done]
        idle = [s for s in self.active if not s.busy]
        if idle and (len(self.active) >= self.mix.active_sessions or self.rng.random() >= 0.3):
            return self.rng.choice(idle)
        api = CHAT if self.rng.random() < self.mix.chat_share else GENERATE
        system = system_prompt(self.rng.randrange(SYSTEM_PROMPTS))
        self.started += 1
        session = Session(self.started, api, system, self.rng.randint(*self.mix.turns))
        self.active.append(session)
        return session


@dataclass
class LoadResult:
    records: list[Record]
    sessions: int
    elapsed_s: float  # from the first arrival to the last answer


async def run_load(
    url: str,
    rps: float,
    duration_s: float,
    seed: int,
    on_record: Callable[[Record], None],
    origin: float | None = None,
    mix: Mix = Mix(),
) -> LoadResult:
    """Poisson arrivals at `rps` for `duration_s` from `origin` (a time.perf_counter() value;
    default now), then every answer awaited."""
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
                records.append(record := Record(kind="bad", sent_s=t))
                return bad(record)
            session = sessions.next()
            session.ask(rng)
            session.busy = True
            stream = rng.random() < mix.stream_share
            kind = "abandon" if stream and rng.random() < mix.abandon_share else "normal"
            record = Record(0, session.id, session.turn, session.api, stream, kind, sent_s=t)
            data = body(session.api, session.prompt(), rng.randint(*mix.max_tokens), stream=stream)
            records.append(record)
            return turn(session, record, data)

        elapsed = await poisson(rps, duration_s, rng, arrive, origin)
    return LoadResult(records, sessions.started, elapsed)
