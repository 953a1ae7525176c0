"""The oracle hit ratio: the workload's prompts replayed into one infinite prefix cache.

Requests are replayed in the order they were sent. Each one reuses the longest run of whole
16-token pages it shares with anything cached before it (at least one prompt token is always
computed, as the workers do), then its prompt and its answer are cached (the answer both as
the model's tokens and as the next turn's chat template renders it). No eviction and one
instance: no routing or capacity can do better, so this bounds every system's hit ratio.

The LRU reference (`LruCaches`) replays the same requests into the cluster's caches as they
are: one per prefill worker, of the run's device KV, evicting the least recently used pages
as SGLang's radix cache does, each prompt sent where its longest prefix is (perfect
locality, no load). What it loses to the oracle is lost to cache size and LRU eviction, not
to routing; what a system loses below it is the price of its routing (or of spreading load).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.load.record import Record
from benchmarks.multiturn.workloads import CHAT, Request
from router.policies import reusable

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
        held = held_pages(self.pages, page_keys(ids, self.page))
        return reusable(held * self.page, len(ids), self.page)

    def add(self, ids: Sequence[int]) -> None:
        self.pages.update(page_keys(ids, self.page))

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page


class LruCaches:
    """`servers` page caches of `capacity_tokens` each, least recently used pages evicted
    first (a prefix's pages are touched last to first, so a parent outlives its children,
    as leaves go first in a radix cache). `serve(ids)` sends a prompt to the cache holding
    its longest prefix (among equals, the one given a prompt longest ago), returns its hit
    (page-aligned, last token computed) and caches the prompt there; `add(ids)` caches more
    of that request (its answer) on the same cache."""

    def __init__(self, servers: int, capacity_tokens: int, page: int = PAGE) -> None:
        if servers < 1 or capacity_tokens < page:
            raise ValueError(
                f"LRU caches need a server and a page of room, got {servers} of "
                f"{capacity_tokens} tokens"
            )
        self.page = page
        self.capacity_pages = capacity_tokens // page
        self.caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(servers)]
        self._last_used = [0] * servers
        self._clock = 0
        self._current = 0

    def serve(self, ids: Sequence[int]) -> int:
        keys = page_keys(ids, self.page)
        held = [held_pages(cache, keys) for cache in self.caches]
        self._current = min(range(len(self.caches)), key=lambda i: (-held[i], self._last_used[i]))
        self._clock += 1
        self._last_used[self._current] = self._clock
        self._insert(keys)
        return reusable(held[self._current] * self.page, len(ids), self.page)

    def add(self, ids: Sequence[int]) -> None:
        self._insert(page_keys(ids, self.page))

    def _insert(self, keys: list[int]) -> None:
        lru_insert(self.caches[self._current], keys, self.capacity_pages)


def lru_insert(cache: OrderedDict[int, None], keys: Sequence[int], capacity_pages: int) -> None:
    """Cache a prompt's page `keys` as most recently used (a parent outlives its children),
    evicting the least recently used pages beyond `capacity_pages`."""
    for key in reversed(keys):
        cache[key] = None
        cache.move_to_end(key)
    while len(cache) > capacity_pages:
        cache.popitem(last=False)


def held_pages(cache: Container[int], keys: Sequence[int]) -> int:
    """How many of `keys`, from the first, the cache holds."""
    n = 0
    for key in keys:
        if key not in cache:
            break
        n += 1
    return n


def prompt_ids(tokenizer: Any, request: Request, outcome: Record) -> list[int] | None:
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
    lru_hits: list[int | None] | None = None  # the LRU reference's, when it was asked for


def replay(
    tokenizer: Any,
    requests: Sequence[Request],
    outcomes: Sequence[Record],
    lru: LruCaches | None = None,
) -> Replay:
    """The requests replayed in the order they were sent into one infinite cache, and into
    `lru` when given (its hits in `lru_hits`)."""
    oracle = PrefixOracle()
    hits: list[int | None] = [None] * len(requests)
    lengths: list[int | None] = [None] * len(requests)
    lru_hits: list[int | None] | None = None if lru is None else [None] * len(requests)
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
        if lru is not None and lru_hits is not None:
            lru_hits[rid] = lru.serve(ids)
        for seq in _cached_sequences(tokenizer, request, outcome, ids):
            oracle.add(seq)
            if lru is not None and seq is not ids:
                lru.add(seq)
    return Replay(hits, lengths, oracle.tokens, lru_hits)


def _cached_sequences(
    tokenizer: Any, request: Request, outcome: Record, ids: list[int]
) -> Iterable[list[int]]:
    yield ids
    if not outcome.answer:
        return
    answer = tokenizer.encode(outcome.answer, add_special_tokens=False)
    yield ids + answer  # what a worker caches: prompt plus the generated tokens
    if request.route == CHAT and outcome.messages is not None:
        resent = [*outcome.messages, {"role": "assistant", "content": outcome.answer}]
        yield list(tokenizer.encode_chat(resent, add_generation_prompt=False))
