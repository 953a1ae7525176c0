"""A workload's working set before it runs, and the KV capacity that makes it a given multiple.

The working set is the number of distinct tokens the workload caches: every prompt and every
answer, shared prefixes counted once, in whole 16-token pages. After a run the oracle's pages
give it exactly (`oracle.Replay.distinct_tokens`). Before the run the answers do not exist
yet, so the plan is replayed into the same oracle with stand-in answers of the planned
lengths (single-token words, as the sim's answers are): the chat histories are then the
ones the run will send, up to the answers' words.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from benchmarks.load.causal import messages_for
from benchmarks.load.record import Record
from benchmarks.multiturn.oracle import PAGE, Replay, page_keys, replay
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import CHAT, Request, Workload


def planned_outcomes(workload: Workload, vocab: Vocab) -> list[Record]:
    """Outcomes as the run will produce them: sent at the planned times, each answer
    `max_tokens` words long, each chat carrying its parent's history and answer."""
    requests = workload.requests
    outcomes = [Record(r.rid, r.session, r.turn) for r in requests]
    for request in sorted(requests, key=lambda r: (r.turn, r.at_s, r.rid)):  # parents first
        outcome = outcomes[request.rid]
        outcome.sent_s = request.at_s
        parent = None if request.parent is None else outcomes[request.parent]
        if request.route == CHAT:
            outcome.messages = messages_for(request, parent)
        outcome.answer, _ = vocab.words_text(random.Random(request.rid), request.max_tokens)
    return outcomes


def estimate(workload: Workload, vocab: Vocab, encoder: Any) -> Replay:
    """The oracle's replay of the plan with stand-in answers (`distinct_tokens` is the
    estimated working set)."""
    return replay(encoder, workload.requests, planned_outcomes(workload, vocab))


def largest_request(workload: Workload, planned: Replay) -> int:
    """Tokens of the largest request's prompt plus answer: an instance must hold it."""
    return max(
        (n + r.max_tokens for r, n in zip(workload.requests, planned.lengths, strict=True) if n),
        default=0,
    )


@dataclass(frozen=True)
class Sizing:
    """Per-instance device ("GPU") KV so that `working_set` is `multiple` x the cluster's."""

    working_set: int
    multiple: float
    instances: int
    page: int = PAGE

    @property
    def instance_tokens(self) -> int:
        """Whole pages, rounded down (the multiple is then at least the one asked for)."""
        pages = int(self.working_set / (self.multiple * self.instances)) // self.page
        return pages * self.page

    @property
    def cluster_tokens(self) -> int:
        return self.instance_tokens * self.instances

    def multiple_of(self, working_set: int) -> float:
        """What multiple of this cluster's KV another working set is."""
        return working_set / self.cluster_tokens if self.cluster_tokens else float("inf")

    def check_fits(self, largest: int) -> None:
        """ValueError when the largest request (prompt + answer, plus one page) does not fit
        one instance: a sim worker refuses it, and the run would measure refusals."""
        need = -(-largest // self.page) * self.page + self.page
        if self.instance_tokens < need:
            raise ValueError(
                f"a working set of {self.working_set:,} tokens at {self.multiple:g}x "
                f"{self.instances} instances leaves {self.instance_tokens:,} tokens per "
                f"instance, less than the largest request needs ({need:,}): use a larger "
                "workload (more sessions) or smaller requests"
            )


def planned_prompt_ids(request: Request, encoder: Any = None) -> list[int]:
    """A request's prompt ids as planned: a completion's own; a chat's first-turn messages
    (no parent's history) through the chat template of `encoder` (none without one)."""
    if request.route != CHAT:
        return list(request.prompt_ids or [])
    if encoder is None:
        return []
    return list(encoder.encode_chat(messages_for(request, None)))


def hot_set_tokens(workload: Workload, page: int = PAGE, encoder: Any = None) -> int:
    """Tokens of the prompt pages at least two requests contain (completion prompts, whose
    ids the plan knows; chats' with `encoder`, `planned_prompt_ids`): the set a cache must
    keep for reuse to happen at all (pages seen once are compulsory misses, whoever
    routes)."""
    seen: Counter[int] = Counter()
    for request in workload.requests:
        seen.update(set(page_keys(planned_prompt_ids(request, encoder), page)))
    return sum(1 for n in seen.values() if n >= 2) * page
