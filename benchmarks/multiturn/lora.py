"""A LoRA workload: requests for many adapters of Zipf popularity, each adapter's prompts
sharing that adapter's prefix.

A gateway in front of fine-tuned adapters (one per customer or task) sees a few hot adapters
and a long tail, and each adapter's requests start with that adapter's own text: its system
prompt, then one of its few documents (a product manual, a code base, a policy), then a
short new question. A router then has two things to place together: the adapter (a worker
that has not loaded it loads it before the prefill, evicting another past its
`--max-loaded-loras`) and the prefix (a worker that holds it skips most of the prefill).

Adapter k of `adapters` is chosen with probability proportional to rank^-s (Zipf; the ranks
shuffled against the names, so the hottest adapter is not always `lora00`, the first a
worker loads at start); within it, one of its `documents` uniformly. Requests are
independent and arrive open-loop as one Poisson process; every prompt is a completion of
one-token words (`text.Vocab`), so its token ids are known exactly (the oracle, the working
set and the floor need no tokenizer). Different adapters' texts share no page: an engine
keys its cache by adapter anyway, so the oracle's token-only cache counts no hit across
adapters either.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from typing import Any

from benchmarks.multiturn.hot_prefix import zipf_weights
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import COMPLETION, Request, Workload, _params, poisson_times


def adapter_name(k: int) -> str:
    """The k-th adapter's name, as the workers register it (`--lora-paths NAME=PATH`)."""
    return f"lora{k:02d}"


@dataclass(frozen=True)
class LoraPrefix:
    """`requests` requests at `rate`/s (Poisson) for adapter k of `adapters` with
    Zipf(`zipf_exponent`) popularity: the adapter's system prompt (`system_min`..`max`
    tokens), one of its `documents` (`document_min`..`max` tokens, uniformly chosen), a
    unique question (`question_min`..`max` tokens, log-uniform), an answer of
    `answer_tokens`."""

    adapters: int = 20
    zipf_exponent: float = 1.0
    documents: int = 3
    system_min_tokens: int = 500
    system_max_tokens: int = 1500
    document_min_tokens: int = 1000
    document_max_tokens: int = 3000
    question_min_tokens: int = 20
    question_max_tokens: int = 200
    answer_tokens: int = 16
    requests: int = 200
    rate: float = 4.0
    seed: int = 1

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> LoraPrefix:
        """The builder a run recorded in its `workload_params`."""
        return cls(**{k: params[k] for k in cls.__dataclass_fields__ if k in params})

    @property
    def adapter_names(self) -> list[str]:
        return [adapter_name(k) for k in range(self.adapters)]

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"lora:{self.seed}")
        ranks = list(range(self.adapters))  # ranks[r]: the adapter of popularity rank r
        rng.shuffle(ranks)
        cumulative = list(itertools.accumulate(zipf_weights(self.adapters, self.zipf_exponent)))
        texts: dict[tuple[int, int], tuple[str, list[int]]] = {}

        def text(adapter: int, part: int) -> tuple[str, list[int]]:
            """Part 0 of an adapter: its system prompt; part d > 0: its document d."""
            if (adapter, part) not in texts:
                words = random.Random(f"lora:{self.seed}:{adapter}:{part}")
                lo, hi = (
                    (self.system_min_tokens, self.system_max_tokens)
                    if part == 0
                    else (self.document_min_tokens, self.document_max_tokens)
                )
                texts[(adapter, part)] = vocab.words_text(words, words.randint(lo, hi))
            return texts[(adapter, part)]

        requests = []
        chosen: list[int] = []
        for rid, at in enumerate(poisson_times(rng, self.requests, self.rate)):
            rank = min(bisect.bisect_left(cumulative, rng.random()), self.adapters - 1)
            adapter = ranks[rank]
            chosen.append(adapter)
            document = 1 + rng.randrange(self.documents)
            question_len = round(
                self.question_min_tokens
                * (self.question_max_tokens / self.question_min_tokens) ** rng.random()
            )
            system, system_ids = text(adapter, 0)
            doc, doc_ids = text(adapter, document)
            question, question_ids = vocab.words_text(rng, question_len)
            request = Request(rid, f"q{rid}", 0, at, self.answer_tokens, COMPLETION)
            request.prompt = system + doc + question
            request.prompt_ids = [*system_ids, *doc_ids, *question_ids]
            request.lora = adapter_name(adapter)
            requests.append(request)
        counts = sorted((chosen.count(a) for a in set(chosen)), reverse=True)
        prompt_tokens = sum(len(r.prompt_ids or []) for r in requests)
        params: dict[str, Any] = {
            **_params(self),
            "distinct_adapters_used": len(counts),
            "hottest_adapter_share": counts[0] / len(chosen),
            "top4_adapters_share": sum(counts[:4]) / len(chosen),
            "mean_prompt_tokens": prompt_tokens / len(requests),
        }
        title = "LoRA adapters of Zipf popularity, prefixes per adapter"
        return Workload("lora", title, requests, params)
