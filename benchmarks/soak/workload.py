"""Multi-turn sessions and the request bodies they send.

A session keeps one API (/v1/chat/completions or /generate) and one of a few shared system
prompts, so sessions share prefixes across the cluster; each turn adds a new user message to
the history it resends, and the answer it got is appended, so prompt trees and caches grow
until the session ends (a cap keeps every prompt well inside one worker's small device KV).
A few requests are deliberately malformed (the router must answer 400) and a few streams
are abandoned after their first chunk.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from benchmarks.load.bodies import CHAT, GENERATE

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
    def history_words(self) -> int:
        return sum(len(m["content"].split()) for m in self.messages)

    @property
    def done(self) -> bool:
        return self.turns_left <= 0 or self.history_words > MAX_HISTORY_WORDS

    def ask(self, rng: random.Random) -> None:
        self.messages.append({"role": "user", "content": words(rng, rng.randint(15, 70))})

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.turns_left -= 1
        self.turn += 1

    def prompt(self) -> list[dict[str, str]] | str:
        """What the next turn sends: the chat, or for /generate the chat as plain text."""
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
        """An idle, unfinished session, or a new one when there are too few idle ones (the
        load is open loop: a busy session never holds an arrival back)."""
        self.active = [s for s in self.active if s.busy or not s.done]
        idle = [s for s in self.active if not s.busy]
        if not idle or (len(self.active) < self.mix.active_sessions and self.rng.random() < 0.3):
            session = self.new()
            self.active.append(session)
            return session
        return self.rng.choice(idle)

    def new(self) -> Session:
        api = CHAT if self.rng.random() < self.mix.chat_share else GENERATE
        system = system_prompt(self.rng.randrange(SYSTEM_PROMPTS))
        turns = self.rng.randint(*self.mix.turns)
        self.started += 1
        return Session(self.started, api, system, turns)
