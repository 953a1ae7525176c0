"""Sending a request to workers: one retry loop, one in-flight path, strategies plugged in.

A `Strategy` decides where a request goes (one colocated worker, or a prefill/decode pair)
and how it is sent; the `Dispatcher` runs it with sglang-router's retry rules (another worker
after a failure before the first byte, with backoff) and hands what came back to the
learning step, off this request's path. `Sender` is what every strategy sends with: the
worker counted in flight, the optimistic tree record, the answer relayed to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.forward.feedback import Learner, Served
from router.forward.relay import Outcome, RetryConfig, WorkerUnavailable, forward
from router.forward.reply import ClientSide, Stream, Whole
from router.forward.upstream import UpstreamPool
from router.metrics import RouterMetrics
from router.policies import CostModel, Decision, Policy, RouteRequest, select_idle_first
from router.request import RequestError
from router.trees import PromptTrees
from router.workers import Worker, WorkerRegistry, WorkerType

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Call:
    """One inference request on its way through the router."""

    client: ClientSide
    route: str
    body: dict[str, Any]
    raw: bytes
    prompt: RouteRequest
    arrived: float = 0.0  # time.perf_counter() when the router received it
    policy: Policy | None = None  # its model's, when it is not the strategy's (router.models)

    @property
    def streamed(self) -> bool:
        return self.body.get("stream") is True


@dataclass(slots=True)
class Attempt:
    """A request a strategy sent: the client's response, and what each worker did."""

    response: Whole | Stream
    answer: Outcome  # the answering worker's (a PD pair's decode)
    served: list[Served]
    # the caches (tree, worker) that now hold the prompt plus its answer: the next prefix
    holders: list[tuple[WorkerType, Worker]] = field(default_factory=list)


class AttemptFailed(Exception):
    """`worker` failed before anything reached the client: the request may go elsewhere."""

    def __init__(self, worker: Worker, cause: WorkerUnavailable, side: str | None) -> None:
        super().__init__(str(cause))
        self.worker = worker
        self.status = cause.status
        self.side = side  # "decode" for a PD pair's decode, None for a colocated worker


class Strategy(ABC):
    """Where a request goes and how it is sent."""

    policies: Sequence[Policy]
    registry: WorkerRegistry
    unit = "worker"  # what the strategy sends to, for error messages

    @abstractmethod
    def kinds(self) -> tuple[WorkerType, ...]:
        """The worker types this strategy routes to (readiness needs one of each); the
        first is where a new request queues first."""

    def eligible(self) -> list[Worker]:
        """The available workers a new request would queue at first: the ones its policy
        chooses from (colocated workers; a PD pair's prefill)."""
        return self.registry.available(self.kinds()[0])

    @abstractmethod
    async def attempt(self, call: Call, tried: set[str]) -> Attempt | None:
        """Send `call` once, preferring workers not in `tried`; None when no worker is
        available; AttemptFailed when the chosen one failed before the first byte."""


class Sender:
    """Sends to one worker: in flight while it runs, the learner told it will hold the
    prompt."""

    def __init__(
        self,
        upstream: UpstreamPool,
        learner: Learner,
        metrics: RouterMetrics,
        timeout_s: float,
        cost: CostModel | None = None,
    ) -> None:
        self.upstream = upstream
        self.learner = learner  # the one writer to the trees: what is sent, what came back
        self.trees: PromptTrees = learner.trees  # (read here, to name holders)
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.uses_tokens = learner.uses_tokens
        self.cost = cost  # to price an answer's work as the engine reports it went

    def pending(self, prompt: RouteRequest, decision: Decision) -> int:
        """Prompt tokens the worker is expected to compute (none of a prefix it pulls)."""
        reused = decision.predicted_cached + decision.planned_pull
        return max(prompt.num_tokens - reused, 0)

    def _observe_speed(
        self, prompt: RouteRequest, decision: Decision, answer: Outcome, seconds: float
    ) -> None:
        """Tell the worker's speed (router.speed) how long the answer's first byte took
        against the work it turned out to be: the engine's reported cached and pulled
        tokens where it reports them (a planned pull may find its holder evicted, a
        predicted hit its pages gone), else the work the decision priced."""
        work = decision.work
        if work is None or answer.status != 200:
            return
        if answer.cached_tokens is not None and self.cost is not None:
            work = self.cost.served_work(
                decision, prompt.num_tokens, answer.cached_tokens, answer.pulled_tokens or 0
            )
        decision.worker.speed.observe(seconds, work)

    def _first_token(self, call: Call, then: Callable[[], None]) -> Callable[[], None]:
        """`then`, after observing the request's time to first token (a streamed answer's
        first bytes are its first token)."""
        ttft = self.metrics.ttft_for(call.route)
        group = self.metrics.groups.labels(call.prompt.tenant, call.prompt.adapter)
        by_group = None if group is None else self.metrics.groups.ttft.labels(*group)
        model = call.prompt.model
        by_model = None if model is None else self.metrics.models.ttft.labels(model)

        def first_byte() -> None:
            seconds = time.perf_counter() - call.arrived
            ttft.observe(seconds)
            if by_group is not None:
                by_group.observe(seconds)
            if by_model is not None:
                by_model.observe(seconds)
            then()

        return first_byte

    async def relay(
        self,
        call: Call,
        payload: bytes,
        decision: Decision,
        outcome: Outcome,
        tree: WorkerType | None,
        side: str | None = None,
    ) -> Whole | Stream:
        """Forward to `decision.worker` and relay its answer; `tree`: the prompt tree that
        learns the worker is about to hold the prompt. AttemptFailed before the first byte."""
        worker = decision.worker
        self.metrics.event(decision.reason).inc()
        hit = self.metrics.cache_hits if decision.predicted_cached else self.metrics.cache_misses
        hit.inc()
        if tree is not None:
            self.learner.record_soon(tree, worker, call.prompt)
        if call.prompt.charge is not None and side != "decode":  # its computed tokens
            call.prompt.charge_computed(self.pending(call.prompt, decision))
        source = decision.pull_from  # its link is shared by the pulls planned from it
        pulling = source.serving_pull() if source is not None else contextlib.nullcontext()
        adapter = call.prompt.adapter  # held in the engine's memory while the request runs
        holding = worker.adapters.serving(adapter) if adapter else contextlib.nullcontext()
        try:
            begins = call.streamed or side == "prefill"  # its first byte marks its start
            timed = None
            with (
                pulling,
                holding,
                worker.request(
                    self.pending(call.prompt, decision), begins, decision.load_s
                ) as flight,
            ):
                first_byte = flight.prefill_done
                if begins and side != "decode" and decision.work is not None:
                    # (a decode's first byte waits for its prefill: not its own speed)
                    timed = FirstByte(first_byte)
                    first_byte = timed
                if side != "prefill" and call.streamed:  # the first token reaches the client
                    first_byte = self._first_token(call, first_byte)
                answer = await forward(
                    self.upstream,
                    call.client,
                    worker.url + call.route,
                    payload,
                    self.timeout_s,
                    outcome,
                    first_byte,
                    inspect=self.uses_tokens,  # only token policies learn from answers
                    watch=worker.exchanges,
                )
            if timed is not None and timed.seconds is not None:
                self._observe_speed(call.prompt, decision, outcome, timed.seconds)
            return answer
        except WorkerUnavailable as exc:
            raise AttemptFailed(worker, exc, side) from None
        finally:
            self.metrics.for_worker(worker.url).inc()


class FirstByte:
    """Calls `then` at an answer's first byte, noting how long it took from now."""

    __slots__ = ("_sent", "_then", "seconds")

    def __init__(self, then: Callable[[], None]) -> None:
        self._sent = time.perf_counter()
        self._then = then
        self.seconds: float | None = None  # from the send to the first byte, once seen

    def __call__(self) -> None:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self._sent
        self._then()


class Colocated(Strategy):
    """One worker per request, picked by the policy among colocated workers."""

    def __init__(self, policy: Policy, registry: WorkerRegistry, sender: Sender) -> None:
        self.policy = policy
        self.policies = (policy,)
        self.registry = registry
        self.sender = sender

    def kinds(self) -> tuple[WorkerType, ...]:
        return (WorkerType.COLOCATED,)

    async def attempt(self, call: Call, tried: set[str]) -> Attempt | None:
        available = self.registry.available(call.prompt.type, call.prompt.model)
        workers = [w for w in available if w.url not in tried] or available
        if not workers:
            return None
        decision = select_idle_first(
            call.policy or self.policy, call.prompt, workers, self.registry
        )
        outcome = Outcome()
        payload = with_prefix_holders(call.body, call.raw, decision)
        response = await self.sender.relay(call, payload, decision, outcome, WorkerType.COLOCATED)
        worker, tree = decision.worker, WorkerType.COLOCATED
        served = Served(worker, tree, decision.predicted_cached, outcome.cached_tokens)
        served.error = outcome.error
        return Attempt(response, outcome, [served], [(tree, worker)])


def prefix_holders_field(decision: Decision) -> dict[str, Any]:
    """`{"memserve": {"prefix_holders": [...]}}` naming the workers that hold a longer prefix
    than the chosen one, with their MemPool agents (an extra field a real SGLang server
    ignores; our workers may pull from those holders); {} when there are none."""
    if not decision.holders:
        return {}
    named = [
        {"url": w.url, "cached_tokens": n, **(w.agent.hint() if w.agent else {})}
        for w, n in decision.holders
    ]
    return {"memserve": {"prefix_holders": named}}


def with_prefix_holders(body: dict[str, Any], raw: bytes, decision: Decision) -> bytes:
    """The client's body unchanged, unless longer prefixes elsewhere are worth naming."""
    field = prefix_holders_field(decision)
    return msgspec.json.encode({**body, **field}) if field else raw


class Dispatcher:
    """Runs a strategy with retries, then schedules the learning step."""

    def __init__(
        self,
        strategy: Strategy,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        learner: Learner,
        retry: RetryConfig,
    ) -> None:
        self.strategy = strategy
        self.registry = registry
        self.metrics = metrics
        self.learner = learner
        self.retry = retry

    async def dispatch(self, call: Call) -> Whole | Stream:
        """The first attempt that reaches the client; 503 when every one failed."""
        retry = self.retry
        attempts = 1 + (retry.max_retries if retry.enabled else 0)
        tried: set[str] = set()
        last_error = f"no healthy {self.strategy.unit}"
        for attempt in range(attempts):
            try:
                sent = await self.strategy.attempt(call, tried)
            except AttemptFailed as exc:
                last_error = str(exc)
                log.warning(
                    "%s %s failed (attempt %d of %d): %s",
                    exc.side or "worker",
                    exc.worker.url,
                    attempt + 1,
                    attempts,
                    exc,
                )
                tried.add(exc.worker.url)
                self.registry.record_failure(exc.worker)
                if exc.status == 502:
                    self.registry.mark_dead(exc.worker)
                if exc.side is None:
                    self.metrics.errors.labels(call.route, "worker").inc()
                else:
                    self.metrics.pd_errors.labels(exc.side).inc()
                if attempt + 1 < attempts:
                    self.metrics.retries.inc()
                    await asyncio.sleep(retry.backoff(attempt))
                continue
            if sent is None:
                break
            self.learner.learn_later(
                (call.route, call.prompt, sent.answer, sent.served, sent.holders)
            )
            return sent.response
        what = self.strategy.unit
        raise RequestError(
            503, f"no {what} could serve the request: {last_error}", {"Retry-After": "1"}
        )
