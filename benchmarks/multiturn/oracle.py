"""The oracle hit ratio: the workload's prompts replayed into one infinite prefix cache.

Requests are replayed in the order they were sent. Each one reuses the longest run of whole
16-token pages it shares with anything cached before it (at least one prompt token is always
computed, as the workers do), then its prompt and its answer are cached (the answer both as
the model's tokens and as the next turn's chat template renders it). No eviction and one
instance: no routing or capacity can do better, so this bounds every system's hit ratio.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.multiturn.client import Outcome
from benchmarks.multiturn.workloads import CHAT, Request

PAGE = 16


def page_keys(ids: Sequence[int], page: int = PAGE) -> list[int]:
    """Chained hashes of the whole pages of `ids` (a page's key names its whole prefix)."""
    keys, h = [], 0
    for start in range(0, len(ids) - page + 1, page):
        h = hash((h, tuple(ids[start : start + page])))
        keys.append(h)
    return keys


class PrefixOracle:
    """An infinite page cache: `hit(ids)` (page-aligned, last token computed), `add(ids)`;
    `tokens`, the distinct tokens it holds: the workload's working set."""

    def __init__(self, page: int = PAGE) -> None:
        self.page = page
        self.pages: set[int] = set()

    def hit(self, ids: Sequence[int]) -> int:
        n = 0
        for key in page_keys(ids, self.page):
            if key not in self.pages:
                break
            n += 1
        return min(n * self.page, (len(ids) - 1) // self.page * self.page)

    def add(self, ids: Sequence[int]) -> None:
        self.pages.update(page_keys(ids, self.page))

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page


def prompt_ids(tokenizer: Any, request: Request, outcome: Outcome) -> list[int] | None:
    """The prompt's token ids as the worker computes them."""
    if request.route != CHAT:
        return list(request.prompt_ids or [])
    if outcome.messages is None:
        return None
    return list(tokenizer.encode_chat(outcome.messages))


@dataclass
class Replay:
    """The oracle's figures for one run: per request its cached and prompt tokens (None for
    one never sent), and the distinct tokens of everything cached (the working set)."""

    hits: list[int | None]
    lengths: list[int | None]
    distinct_tokens: int


def replay(tokenizer: Any, requests: Sequence[Request], outcomes: Sequence[Outcome]) -> Replay:
    """The requests replayed in the order they were sent into one infinite cache."""
    oracle = PrefixOracle()
    hits: list[int | None] = [None] * len(requests)
    lengths: list[int | None] = [None] * len(requests)
    sent = sorted(
        (o.sent_s, o.rid) for o in outcomes if o.sent_s is not None
    )  # replay in send order
    for _, rid in sent:
        request, outcome = requests[rid], outcomes[rid]
        ids = prompt_ids(tokenizer, request, outcome)
        if not ids:
            continue
        hits[rid] = oracle.hit(ids)
        lengths[rid] = len(ids)
        for seq in _cached_sequences(tokenizer, request, outcome, ids):
            oracle.add(seq)
    return Replay(hits, lengths, oracle.tokens)


def _cached_sequences(
    tokenizer: Any, request: Request, outcome: Outcome, ids: list[int]
) -> Iterable[list[int]]:
    yield ids
    if not outcome.answer:
        return
    answer = tokenizer.encode(outcome.answer, add_special_tokens=False)
    yield ids + answer  # what a worker caches: prompt plus the generated tokens
    if request.route == CHAT and outcome.messages is not None:
        resent = [*outcome.messages, {"role": "assistant", "content": outcome.answer}]
        yield list(tokenizer.encode_chat(resent, add_generation_prompt=False))
