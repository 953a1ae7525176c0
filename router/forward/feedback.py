"""What the trees learn from the forwarding path: the prompt a worker was sent, then its
answer's circuit breaker, feedback on cached tokens and the next prefix.

One step for every strategy: each worker that served the request (a colocated worker, or a
PD pair's prefill and decode) is told to its breaker; the trees are corrected by what each
reported as cached (and the router's accuracy watch, router.accuracy, counts the same
figures per worker); and the trees that now hold the prompt plus its answer (the next turn's
prefix) record it. It runs after the answer, off every request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from router.forward.relay import Outcome
from router.metrics import RouterMetrics
from router.policies import RouteRequest
from router.request import encoded, full_tokens, when_encoded
from router.trees import PromptTrees
from router.workers import Worker, WorkerRegistry, WorkerType
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)

LEARN_DELAY_S = 0.002  # tree updates from an answer wait this long: the loop is idle by then


@dataclass(slots=True)
class Served:
    """What one worker did for a request."""

    worker: Worker
    tree: WorkerType  # the prompt tree its cache is in
    predicted: int  # cached tokens the trees predicted for it
    reported: int | None  # cached tokens it reported (None: not reported, or not its role)
    error: str | None = None
    side: str | None = None  # metrics label: "prefill"/"decode" in a PD pair, None colocated


# learn()'s arguments: route, prompt, answer, served, holders
LearnArgs: TypeAlias = tuple[
    str, RouteRequest, Outcome, Sequence[Served], Sequence[tuple[WorkerType, Worker]]
]


class Learner:
    """The forwarding path's one writer to the trees: the prompt a worker was sent (at the
    send) and what its answer taught (after it), with the breakers."""

    def __init__(
        self,
        trees: PromptTrees,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        encoder: CachedEncoder | None,
        uses_tokens: bool,
        idle: Callable[[], bool],
        exact: bool = False,
    ) -> None:
        self.trees = trees
        self.registry = registry
        self.metrics = metrics
        self.encoder = encoder
        self.uses_tokens = uses_tokens
        self.idle = idle  # True when the router has CPU to spare for pre-encoding
        # Workers publish KV events: they tell the trees what each cached, exactly and at
        # once; recording the answer here too could re-add pages their events already
        # removed (a full cache evicts within steps), leaving phantom holders until the TTL.
        self.exact = exact
        self._waiting: deque[tuple[float, LearnArgs]] = deque()  # (due, what to learn from)
        self._timer: asyncio.TimerHandle | None = None

    def encoder_of(self, prompt: RouteRequest) -> CachedEncoder | None:
        """The encoder of the prompt's model (router.models), else the router's."""
        return self.encoder if prompt.encoder is None else prompt.encoder

    def record_soon(self, tree: WorkerType, worker: Worker, prompt: RouteRequest) -> None:
        """Optimistic, at the send: `worker` is about to hold the prompt (its new text
        encoded first, right after the send, off the request's path)."""
        if prompt.tokens is not None and self.uses_tokens:
            record = functools.partial(self._record_sent, tree, worker.url, prompt)
            asyncio.get_running_loop().call_soon(
                when_encoded, prompt, self.encoder_of(prompt), record
            )

    def _record_sent(
        self, tree: WorkerType, url: str, prompt: RouteRequest, tokens: array[int] | None
    ) -> None:
        if tokens:
            key = prompt.tree_key(tokens, self.trees.page_size)
            self.trees.record(tree, url, key, tenant=prompt.tenant)
            if prompt.recorded is None:
                prompt.recorded = []
            prompt.recorded.append((tree, url, time.monotonic()))

    def learn_later(self, args: LearnArgs) -> None:
        """`learn(*args)`, LEARN_DELAY_S from now: off this request's path, and off the next
        one's (a multi-turn client sends its next turn the moment this answer lands). One
        timer serves every answer waiting: at max load a timer per answer cost more than
        learning."""
        loop = asyncio.get_running_loop()
        due = loop.time() + LEARN_DELAY_S
        self._waiting.append((due, args))
        if self._timer is None:
            self._timer = loop.call_at(due, self._learn_due)

    def _learn_due(self) -> None:
        """Learn from every answer whose delay is over; wake again for the next one, but
        not sooner than LEARN_DELAY_S from now: at max load an answer is due every few
        hundred microseconds, and a loop woken that often spent more on waking than on
        learning (a round_robin router 135.5 -> 106.7 us of CPU a request, measured)."""
        loop = asyncio.get_running_loop()
        now, waiting = loop.time(), self._waiting
        while waiting and waiting[0][0] <= now:
            _, args = waiting.popleft()
            try:
                self.learn(*args)
            except Exception:  # one bad answer must not stop learning from the others
                log.exception("learning from an answer failed")
        if waiting:
            self._timer = loop.call_at(max(waiting[0][0], now + LEARN_DELAY_S), self._learn_due)
        else:
            self._timer = None

    def learn(
        self,
        route: str,
        prompt: RouteRequest,
        answer: Outcome,
        served: Sequence[Served],
        holders: Sequence[tuple[WorkerType, Worker]],
    ) -> None:
        """`answer` came back from the workers in `served`; `holders` now hold the prompt
        and its answer in their caches."""
        for s in served:
            if s.error is None:
                self.registry.record_success(s.worker)
                continue
            self.registry.record_failure(s.worker)
            if s.side is None:
                self.metrics.errors.labels(route, "mid_stream").inc()
            else:
                self.metrics.pd_errors.labels(s.side).inc()
        if answer.error is not None or answer.status != 200:
            return
        group = self.metrics.groups.labels(prompt.tenant, prompt.adapter)
        if group is not None or prompt.model is not None:  # a tenant's, adapter's, model's
            reported = next((s.reported for s in served if s.reported is not None), None)
            if reported is not None:
                for figures, labels in (
                    (self.metrics.groups, group),
                    (self.metrics.models, None if prompt.model is None else (prompt.model,)),
                ):
                    if labels is not None:  # their hit ratio
                        figures.prompt_tokens.labels(*labels).inc(prompt.num_tokens)
                        figures.cached_tokens.labels(*labels).inc(reported)
        # fair admission: charged as predicted, then as computed (not the prediction
        # corrected: the decision may have planned a pull the worker did not make)
        if prompt.charge is not None:
            for s in served:
                if s.reported is not None:
                    prompt.charge_computed(max(prompt.num_tokens - s.reported, 0))
                    break
        if self.uses_tokens:
            self.learn_prefix(prompt, answer, served, holders)

    def learn_prefix(
        self,
        prompt: RouteRequest,
        answer: Outcome,
        served: Sequence[Served],
        holders: Sequence[tuple[WorkerType, Worker]],
    ) -> None:
        """The trees' part of `learn`: feedback, and the prompt plus its answer recorded
        (once a cold prompt's text is encoded, should a thread still be at it)."""
        if not encoded(prompt):
            assert prompt.encoding is not None
            again = self.learn_prefix
            prompt.encoding.add_done_callback(lambda _: again(prompt, answer, served, holders))
            return
        tokens = full_tokens(prompt, self.encoder_of(prompt))
        if not tokens:
            return
        page = self.trees.page_size
        key = prompt.tree_key(tokens, page)
        for s in served:
            if s.reported is not None:
                self.trees.feedback(s.tree, s.worker.url, key, s.predicted, s.reported)
                self.metrics.accuracy.observe(s.worker.url, s.predicted, s.reported)
        prefix = self.next_prefix(prompt, answer)  # (primes the next turn's encode too)
        if self.exact:
            return
        unchanged = self._recorded_as_is(prompt, served, len(tokens), len(prefix))
        next_key = prompt.tree_key(prefix, page)
        for tree, worker in holders:
            if (tree, worker.url) not in unchanged:
                self.trees.record(tree, worker.url, next_key, tenant=prompt.tenant)

    def _recorded_as_is(
        self, prompt: RouteRequest, served: Sequence[Served], tokens: int, prefix: int
    ) -> set[tuple[WorkerType, str]]:
        """The (tree, URL) holdings of the prompt recorded at dispatch that recording the
        next prefix would not change: it adds no whole page, the worker reported no less
        than predicted (no correction dropped the path since) and the record is recent
        (its TTL far off). Recording them again only costs: a tree insert, and with several
        router processes, a message to each sibling."""
        page = self.trees.page_size
        if not prompt.recorded or prefix // page != tokens // page:
            return set()
        corrected = {
            (s.tree, s.worker.url)
            for s in served
            if s.reported is not None and s.reported < s.predicted
        }
        recent = time.monotonic() - self.trees.ttl_s / 2
        return {
            (tree, url)
            for tree, url, at in prompt.recorded
            if at >= recent and (tree, url) not in corrected
        }

    def next_prefix(self, prompt: RouteRequest, answer: Outcome) -> array[int]:
        """The prompt plus what was generated: the next turn's prefix.

        For a chat, the next turn's render of this answer is encoded now too (off every
        request's path): the client sends the answer back verbatim as the assistant message,
        so the next turn only has its new user message left to tokenize.
        """
        chat, enc = prompt.chat, self.encoder_of(prompt)
        if self.idle() and chat is not None and enc is not None and answer.output_text:
            with contextlib.suppress(ValueError):
                enc.prime([*chat, {"role": "assistant", "content": answer.output_text}])
        prefix = array("I", prompt.tokens or ())
        if answer.output_ids is not None:
            prefix.extend(answer.output_ids)
        elif answer.output_text and enc is not None and not self._adds_no_page(len(prefix), answer):
            # (the trees keep whole pages: an answer that ends inside the prompt's last page
            # changes nothing there, as most short answers, and encoding it would cost more
            # than the rest of learning)
            prefix.extend(enc.tokenizer.encode(answer.output_text, add_special_tokens=False))
        return prefix

    def _adds_no_page(self, prompt_tokens: int, answer: Outcome) -> bool:
        """The answer's tokens (as it counts them) end inside the prompt's last page."""
        generated = answer.completion_tokens
        if generated is None:
            return False
        page = self.trees.page_size
        return (prompt_tokens + generated) // page == prompt_tokens // page
