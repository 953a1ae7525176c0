"""The workloads: sessions of requests with arrival times and causal dependencies.

A workload is a flat list of `Request`s in send-plan order. A request waits for its parent
(the previous turn of its session) to be answered, then for its own arrival time, then at
least `gap_s` more; a chat turn carries the parent's messages, the parent's answer and its
own user message, so the history a session resends is the one the model really produced.

Arrivals are Poisson: a global Poisson process of the workload's rate whose events are dealt
to the sessions in a random interleaving (each session's turns in order), as MemServe
samples arrivals for ShareGPT, LooGLE and ReAct. Multi-round QA follows production-stack's
schedule instead (each user sends every users/qps seconds, never two requests at once).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from benchmarks.multiturn.text import Vocab

CHAT = "chat"
COMPLETION = "completion"
OPENAI = "openai"  # /v1/chat/completions, /v1/completions
SGLANG = "sglang"  # /generate: text (a chat rendered with the chat template), meta_info


@dataclass
class Request:
    """One request of the plan; `messages` / `prompt` are filled in when it is sent."""

    rid: int
    session: str
    turn: int  # 0-based within its session
    at_s: float  # earliest send time, from the start of the run
    max_tokens: int
    route: str = CHAT
    parent: int | None = None  # rid of the previous turn (sent after its answer)
    gap_s: float = 0.0  # at least this long after the parent's answer
    base: list[dict[str, str]] | None = None  # chat: messages before the user's turn (turn 0)
    user: str | None = None  # chat: this turn's user message
    carry: bool = True  # chat: resend the parent's history and answer
    prompt: str | None = None  # completion: the whole prompt
    prompt_ids: list[int] | None = None  # completion: its exact token ids
    warmup: bool = False  # sent through the system under test, left out of the figures
    lora: str | None = None  # the LoRA adapter it names (sent as `lora_path`), None: the base
    tenant: str | None = None  # the tenant it is sent for (per-tenant figures)
    api_key: str | None = None  # sent as `Authorization: Bearer` (the tenant's key)


@dataclass
class Workload:
    """A named request plan plus what describes it in the results."""

    name: str
    title: str
    requests: list[Request]
    params: dict[str, Any] = field(default_factory=dict)
    api: str = OPENAI  # how the client sends it: OPENAI or SGLANG

    @property
    def sessions(self) -> int:
        return len({r.session for r in self.requests})

    def max_turns(self) -> int:
        return 1 + max((r.turn for r in self.requests), default=0)


def poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def deal_arrivals(
    rng: random.Random, turns_per_session: Sequence[int], rate: float
) -> list[list[float]]:
    """Poisson arrival times dealt to sessions in a random interleaving: [session][turn]."""
    order = [s for s, n in enumerate(turns_per_session) for _ in range(n)]
    rng.shuffle(order)
    times = poisson_times(rng, len(order), rate)
    out: list[list[float]] = [[] for _ in turns_per_session]
    for s, t in zip(order, times, strict=True):
        out[s].append(t)
    return out


def _chain(
    sessions: list[tuple[str, list[dict[str, str]], list[tuple[str, int]]]],
    arrivals: list[list[float]],
    carry: bool = True,
    gap_s: float = 0.0,
) -> list[Request]:
    """Requests for chat sessions: (name, base messages, [(user message, max_tokens)])."""
    requests: list[Request] = []
    for (name, base, turns), times in zip(sessions, arrivals, strict=True):
        parent = None
        for k, ((user, max_tokens), at) in enumerate(zip(turns, times, strict=True)):
            rid = len(requests)
            requests.append(
                Request(
                    rid,
                    name,
                    k,
                    at,
                    max_tokens,
                    CHAT,
                    parent,
                    gap_s if parent is not None else 0.0,
                    base=base if k == 0 or not carry else None,
                    user=user,
                    carry=carry,
                )
            )
            parent = rid
    requests.sort(key=lambda r: r.at_s)
    return _renumber(requests)


def _poisson_chain(
    rng: random.Random,
    sessions: list[tuple[str, list[dict[str, str]], list[tuple[str, int]]]],
    rate: float,
    carry: bool = True,
) -> list[Request]:
    """`_chain` of the sessions, their turns arriving as one Poisson process of `rate`."""
    return _chain(sessions, deal_arrivals(rng, [len(s[2]) for s in sessions], rate), carry)


def _params(
    config: Any, names: dict[str, str] | None = None, leave: Sequence[str] = ()
) -> dict[str, Any]:
    """A builder's fields as the results name them (`names`: renamed ones), in their order;
    the seed and the fields in `leave` left out."""
    names = names or {}
    return {
        names.get(f.name, f.name): getattr(config, f.name)
        for f in fields(config)
        if f.name != "seed" and f.name not in leave
    }


def _renumber(requests: list[Request]) -> list[Request]:
    """rids in send-plan order (parents keep pointing at the right request)."""
    new = {r.rid: i for i, r in enumerate(requests)}
    for r in requests:
        r.rid = new[r.rid]
        if r.parent is not None:
            r.parent = new[r.parent]
    return requests


def _lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    import math

    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


# --------------------------------------------------------------------------- multi-round QA


@dataclass(frozen=True)
class MultiRoundQA:
    """production-stack's multi-round QA: U concurrent users, R rounds each, a shared system
    prompt of S tokens, a per-user history of H tokens, answers of A tokens, Q requests/s
    overall. As in production-stack, a user who has asked its R questions is replaced by a
    new one, so U users stay active and the load is steady; each user asks every U/Q s on
    average (exponential gaps: Poisson), never before the previous answer arrived. The run
    ends after `requests` requests.

    The start follows production-stack too. Its ramp-up places the first U users at
    different rounds of their sessions, so users are later replaced one at a time and not in
    waves of U. Its warm-up run preloads those users' contexts before the measured run. Here
    each first user's first request is that warm-up: sent through the system under test and
    not measured. Its next question comes once every warm-up has been sent. Users who join
    later start cold at round 0 and are measured."""

    users: int = 16
    rounds: int = 5
    system_tokens: int = 1000
    history_tokens: int = 20000
    answer_tokens: int = 100
    question_tokens: int = 20
    qps: float = 4.0
    requests: int = 160
    seed: int = 1

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"mrqa:{self.seed}")
        system, _ = vocab.words_text(random.Random(f"mrqa-system:{self.seed}"), self.system_tokens)
        base = [{"role": "system", "content": system}]
        gap = self.users / self.qps  # each user sends every users/qps seconds on average
        starts = poisson_times(rng, self.users, self.qps)  # the warm-ups, at Q/s
        warmed = starts[-1]  # the measured run begins once every warm-up has been sent
        horizon = warmed + self.requests / self.qps
        requests: list[Request] = []
        for slot, at in enumerate(starts):
            user = 0
            first = (slot * self.rounds) // self.users  # the ramp-up: slots spread over rounds
            while at < horizon:
                history, _ = vocab.words_text(rng, self.history_tokens)
                parent = None
                for k in range(first, self.rounds):
                    question, _ = vocab.words_text(rng, self.question_tokens)
                    text = f"Question #{k}:{question}?"
                    if parent is None:
                        text = f"My history:{history}\n{text}"
                    warmup = user == 0 and parent is None
                    requests.append(
                        Request(
                            len(requests),
                            f"user{slot}.{user}",
                            k,
                            at,
                            self.answer_tokens,
                            CHAT,
                            parent,
                            base=base if parent is None else None,
                            user=text,
                            warmup=warmup,
                        )
                    )
                    parent = len(requests) - 1
                    # Exponential gaps: no fixed period that would make round-robin sticky
                    # by accident (a fixed interval, with users a multiple of the instances,
                    # sends each user to the same instance every round).
                    at = max(at, warmed) + rng.expovariate(1 / gap)
                user, first = user + 1, 0
        requests.sort(key=lambda r: r.at_s)
        # `requests` measured ones; a parent is always earlier than its child
        measured = [r for r in requests if not r.warmup][: self.requests]
        cut = measured[-1].at_s if measured else 0.0
        requests = [r for r in requests if r.warmup or r.at_s <= cut]
        return Workload(
            "multi_round_qa",
            "multi-round QA (production-stack)",
            _renumber(requests),
            {
                **_params(
                    self,
                    {
                        "system_tokens": "system_prompt_tokens",
                        "history_tokens": "user_history_tokens",
                    },
                    leave=("requests",),
                ),
                "per_user_interval_s": gap,
                "requests": len(measured),
                "warmup_requests": self.users,
            },
        )


# --------------------------------------------------------------------------- ShareGPT-like


@dataclass(frozen=True)
class ShareGPTLike:
    """Multi-turn chat shaped like ShareGPT: a short system prompt, a few turns of user
    messages (lognormal, mean ~120 tokens) and long answers (mean ~250 tokens)."""

    sessions: int = 60
    mean_turns: float = 4.0
    max_turns: int = 8
    user_mean_tokens: int = 120
    answer_mean_tokens: int = 250
    system_tokens: int = 60
    rate: float = 4.0
    seed: int = 2

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"sharegpt:{self.seed}")
        system, _ = vocab.words_text(random.Random(f"sharegpt-system:{self.seed}"), 60)
        sessions = []
        for s in range(self.sessions):
            turns = min(self.max_turns, 1 + int(rng.expovariate(1 / (self.mean_turns - 1))))
            items = []
            for _ in range(turns):
                text, _ = vocab.words_text(
                    rng, _lognormal_int(rng, self.user_mean_tokens, 0.8, 8, 1500)
                )
                items.append(
                    (text.strip(), _lognormal_int(rng, self.answer_mean_tokens, 0.6, 16, 1024))
                )
            sessions.append((f"chat{s}", [{"role": "system", "content": system}], items))
        return Workload(
            "sharegpt",
            "ShareGPT-like multi-turn chat",
            _poisson_chain(rng, sessions, self.rate),
            _params(self, leave=("system_tokens",)),
        )


# --------------------------------------------------------------------------- LooGLE-like


@dataclass(frozen=True)
class LooGLELike:
    """Long-document QA: each document (system message) is shared by its questions, asked in
    turn (the next after the previous answer; answers are not carried). A share ratio of k
    sends k identical copies of every session (MemServe figure 14)."""

    documents: int = 16
    questions: int = 5
    doc_tokens: int = 6000
    question_tokens: int = 30
    answer_tokens: int = 24
    share_ratio: int = 1
    rate: float = 4.0
    seed: int = 3

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"loogle:{self.seed}")
        base_sessions = []
        for d in range(self.documents):
            doc, _ = vocab.words_text(rng, self.doc_tokens)
            base = [{"role": "system", "content": f"Answer from this document.\n{doc}"}]
            items = []
            for q in range(self.questions):
                text, _ = vocab.words_text(rng, self.question_tokens)
                items.append((f"Question {q}:{text}?", self.answer_tokens))
            base_sessions.append((d, base, items))
        sessions = [
            (f"doc{d}.copy{c}", base, items)
            for c in range(self.share_ratio)
            for d, base, items in base_sessions
        ]
        return Workload(
            "loogle" if self.share_ratio == 1 else f"loogle_share{self.share_ratio}",
            "LooGLE-like document QA"
            + ("" if self.share_ratio == 1 else f", share ratio {self.share_ratio}"),
            _poisson_chain(rng, sessions, self.rate, carry=False),
            _params(self, {"questions": "questions_per_document", "doc_tokens": "document_tokens"}),
        )


# --------------------------------------------------------------------------- ReAct-like


@dataclass(frozen=True)
class ReActLike:
    """Agent loops: a long few-shot prefix shared by every session, a task, then steps of
    thought/action (generated) and an observation (the next user message): a growing
    trajectory resent at every step."""

    sessions: int = 40
    fewshot_tokens: int = 3000
    task_tokens: int = 60
    steps: int = 5
    action_tokens: int = 80
    observation_tokens: int = 150
    rate: float = 4.0
    seed: int = 4

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"react:{self.seed}")
        fewshot, _ = vocab.words_text(
            random.Random(f"react-shots:{self.seed}"), self.fewshot_tokens
        )
        base = [
            {
                "role": "system",
                "content": "Solve the task with Thought/Action/Observation steps. "
                f"Examples:{fewshot}",
            }
        ]
        sessions = []
        for s in range(self.sessions):
            task, _ = vocab.words_text(rng, self.task_tokens)
            items = [(f"Task:{task}", self.action_tokens)]
            for _ in range(self.steps - 1):
                obs, _ = vocab.words_text(
                    rng, _lognormal_int(rng, self.observation_tokens, 0.5, 20, 800)
                )
                items.append((f"Observation:{obs}", self.action_tokens))
            sessions.append((f"agent{s}", base, items))
        return Workload(
            "react",
            "ReAct-like agent loops",
            _poisson_chain(rng, sessions, self.rate),
            _params(self, {"observation_tokens": "observation_mean_tokens"}),
        )
