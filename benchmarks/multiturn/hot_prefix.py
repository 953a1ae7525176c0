"""A tool-agent-like workload: long shared prefixes of Zipf popularity, short unique suffixes.

Agents and tool-calling apps send the same long system and tool prompts again and again,
each time with a short new question, and want a short answer. A few prefixes are very hot,
most are rare: popularity follows Zipf's law (the k-th most popular is chosen with
probability proportional to k^-s). Requests are independent (no session waits for another)
and arrive open-loop as one Poisson process, as Mooncake's tool-agent trace is replayed.

Every prompt is a completion (`/v1/completions`, a prompt string): the prefix's words, then
the suffix's, each word one token (`text.Vocab`), so the token ids of every prompt are known
exactly and the oracle, the working set and the floor need no tokenizer. With `route` CHAT
the same prefixes and suffixes are chats instead (`/v1/chat/completions`): the prefix the
system message, the suffix the user's; their token ids are then the chat template's, which
the oracle encodes.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from typing import Any

from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import (
    CHAT,
    COMPLETION,
    Request,
    Workload,
    _params,
    poisson_times,
)


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Probabilities of ranks 1..n under Zipf's law with this exponent."""
    raw = [k**-exponent for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class HotPrefix:
    """`requests` requests at `rate`/s (Poisson): prefix k of `prefixes` (lengths uniform in
    [min, max] tokens) with Zipf(`zipf_exponent`) popularity, a unique suffix of
    `suffix_min`..`suffix_max` tokens (log-uniform: mostly tens, some hundreds), an answer
    of `answer_tokens`; completions, or chats with `route` CHAT (the prefix the system
    message, the suffix the user's)."""

    prefixes: int = 200
    prefix_min_tokens: int = 4096
    prefix_max_tokens: int = 16384
    zipf_exponent: float = 1.1
    suffix_min_tokens: int = 20
    suffix_max_tokens: int = 400
    answer_tokens: int = 32
    requests: int = 300
    rate: float = 2.0
    route: str = COMPLETION  # COMPLETION (a prompt string) or CHAT (system + user messages)
    seed: int = 1

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> HotPrefix:
        """The builder a run recorded in its `workload_params` (its other entries, figures
        of the built workload, are left out)."""
        return cls(**{k: params[k] for k in cls.__dataclass_fields__ if k in params})

    def build(self, vocab: Vocab) -> Workload:
        if self.route not in (COMPLETION, CHAT):
            raise ValueError(f"route {self.route!r}: {COMPLETION} or {CHAT}")
        rng = random.Random(f"hot-prefix:{self.seed}")
        # The prefixes' popularity order is shuffled against their lengths: the hottest is
        # not always the longest.
        lengths = [
            rng.randint(self.prefix_min_tokens, self.prefix_max_tokens)
            for _ in range(self.prefixes)
        ]
        cumulative = list(itertools.accumulate(zipf_weights(self.prefixes, self.zipf_exponent)))
        prefix_cache: dict[int, tuple[str, list[int]]] = {}

        def prefix(k: int) -> tuple[str, list[int]]:
            if k not in prefix_cache:
                words = random.Random(f"hot-prefix:{self.seed}:prefix:{k}")
                prefix_cache[k] = vocab.words_text(words, lengths[k])
            return prefix_cache[k]

        requests = []
        chosen: list[int] = []
        for rid, at in enumerate(poisson_times(rng, self.requests, self.rate)):
            k = min(bisect.bisect_left(cumulative, rng.random()), self.prefixes - 1)
            chosen.append(k)
            suffix_len = round(
                self.suffix_min_tokens
                * (self.suffix_max_tokens / self.suffix_min_tokens) ** rng.random()
            )
            head, head_ids = prefix(k)
            question, question_ids = vocab.words_text(rng, suffix_len)
            request = Request(rid, f"q{rid}", 0, at, self.answer_tokens, self.route)
            if self.route == CHAT:  # the words without their leading space, as typed
                request.base = [{"role": "system", "content": head.lstrip()}]
                request.user, request.carry = question.lstrip(), False
            else:
                request.prompt, request.prompt_ids = head + question, [*head_ids, *question_ids]
            requests.append(request)
        params: dict[str, Any] = {
            **_params(self),
            "distinct_prefixes_used": len(set(chosen)),
            "hottest_prefix_share": max(chosen.count(k) for k in set(chosen)) / len(chosen),
        }
        if self.route == COMPLETION:  # (a chat's tokens are the template's: the oracle's)
            prompt_tokens = sum(len(r.prompt_ids or []) for r in requests)
            params["mean_prompt_tokens"] = prompt_tokens / len(requests)
        title = "hot shared prefixes (tool-agent-like)" + (", chats" if self.route == CHAT else "")
        return Workload("hot_prefix", title, requests, params)
