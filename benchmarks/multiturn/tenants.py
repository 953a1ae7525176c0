"""A multi-tenant workload: tenants sharing one public tool prompt, each with its own
private documents and questions after it.

A gateway for several products (or customers) sees the same long tool list or system
prompt at the start of every tenant's requests, then that tenant's own text: one of its few
documents (a contract, a code base, a ticket history) and a short new question. With
tenants isolated (each tenant's prompts salted: `--tenants`), an engine caches the tool
prompt once per tenant, unless the operator declares it public, when it is cached once for
all and only what follows is the tenant's own.

Tenant k of `tenants` sends a share `weights[k]` of the requests (equal by default); within
it, one of its `documents` uniformly. Requests are independent, open-loop Poisson arrivals,
completions of one-token words (`text.Vocab`), so every prompt's token ids are known
exactly. The tool prompt is the same for every seed (a gateway's tool list does not change
with the traffic), so one tenants file declares it public for every seed. Each request
carries its tenant's API key (`tenant_key`).
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from typing import Any

from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import COMPLETION, Request, Workload, _params, poisson_times


def tenant_name(k: int) -> str:
    return f"t{k}"


def tenant_key(tenant: str) -> str:
    """The API key the benchmark's client sends for `tenant` (the router keeps its hash)."""
    return f"bench-key-{tenant}"


def tool_prompt(vocab: Vocab, tokens: int) -> tuple[str, list[int]]:
    """The public tool prompt: the same text for every seed and tenant."""
    return vocab.words_text(random.Random("tenants:tool"), tokens)


@dataclass(frozen=True)
class TenantPrefix:
    """`requests` requests at `rate`/s (Poisson) from `tenants` tenants, tenant k sending a
    share `weights[k]` of them (empty: equal): the public tool prompt (`tool_tokens`), one of
    the tenant's `documents` (`document_min`..`max` tokens, uniformly chosen), a unique
    question (`question_min`..`max` tokens, log-uniform), an answer of `answer_tokens`."""

    tenants: int = 4
    weights: tuple[float, ...] = ()
    tool_tokens: int = 3000
    documents: int = 3
    document_min_tokens: int = 1000
    document_max_tokens: int = 2500
    question_min_tokens: int = 20
    question_max_tokens: int = 200
    answer_tokens: int = 16
    requests: int = 240
    rate: float = 4.0
    seed: int = 1

    @property
    def tenant_names(self) -> list[str]:
        return [tenant_name(k) for k in range(self.tenants)]

    def offered_shares(self) -> dict[str, float]:
        """Each tenant's share of the requests, as asked."""
        weights = list(self.weights) or [1.0] * self.tenants
        if len(weights) != self.tenants or min(weights) <= 0:
            raise ValueError(f"weights: one positive weight per tenant ({self.tenants})")
        total = sum(weights)
        return {name: w / total for name, w in zip(self.tenant_names, weights, strict=True)}

    def build(self, vocab: Vocab) -> Workload:
        rng = random.Random(f"tenants:{self.seed}")
        names = self.tenant_names
        cumulative = list(itertools.accumulate(self.offered_shares().values()))
        tool, tool_ids = tool_prompt(vocab, self.tool_tokens)
        documents: dict[tuple[int, int], tuple[str, list[int]]] = {}

        def document(tenant: int, d: int) -> tuple[str, list[int]]:
            if (tenant, d) not in documents:
                words = random.Random(f"tenants:{self.seed}:{tenant}:{d}")
                n = words.randint(self.document_min_tokens, self.document_max_tokens)
                documents[(tenant, d)] = vocab.words_text(words, n)
            return documents[(tenant, d)]

        requests = []
        for rid, at in enumerate(poisson_times(rng, self.requests, self.rate)):
            tenant = min(bisect.bisect_left(cumulative, rng.random()), self.tenants - 1)
            doc, doc_ids = document(tenant, rng.randrange(self.documents))
            question_len = round(
                self.question_min_tokens
                * (self.question_max_tokens / self.question_min_tokens) ** rng.random()
            )
            question, question_ids = vocab.words_text(rng, question_len)
            request = Request(rid, f"q{rid}", 0, at, self.answer_tokens, COMPLETION)
            request.prompt = tool + doc + question
            request.prompt_ids = [*tool_ids, *doc_ids, *question_ids]
            request.tenant = names[tenant]
            request.api_key = tenant_key(names[tenant])
            requests.append(request)
        sent = [r.tenant for r in requests]
        prompt_tokens = sum(len(r.prompt_ids or []) for r in requests)
        params: dict[str, Any] = {
            **_params(self),
            "weights": list(self.weights),
            "sent_shares": {name: sent.count(name) / len(sent) for name in names},
            "mean_prompt_tokens": prompt_tokens / len(requests),
        }
        title = "tenants sharing a public tool prompt, private documents after it"
        return Workload("tenants", title, requests, params)
