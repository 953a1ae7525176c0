"""PD disaggregation in the router: one prefill and one decode instance per request.

As sglang-router does it: pick a prefill instance (by the prefill tree) and a decode
instance (by the decode tree), add `bootstrap_host`, `bootstrap_port` and `bootstrap_room` to
the same JSON body, POST it to both at once; the client gets the decode's answer (streamed
as it comes), the prefill's is drained (its input logprobs are merged into a non-streamed
answer when asked for; router.pd.prefill). The trees follow the caching mode the workers run
(MemServe table 4): which side caches the prompt, and whether decode output returns to
prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

from router.forward.dispatch import (
    Attempt,
    AttemptFailed,
    Call,
    Sender,
    Strategy,
    prefix_holders_field,
)
from router.forward.feedback import Served
from router.forward.relay import Outcome, end_stream
from router.forward.reply import Whole
from router.pd.prefill import PrefillResult, bootstrap_payload, drain_prefill, merge_input_logprobs
from router.pd.write_back import WriteBackGate
from router.policies import Decision, Policy, RouteRequest, reusable, select_idle_first
from router.request import RequestError
from router.workers import Worker, WorkerRegistry, WorkerType
from shared.pd_caching import Caching

# the prefill's decision in sgl_router_load_balancing_events (the decode's keeps its name)
PREFILL_REASON = "prefill_"


@dataclass(slots=True)
class PDSettings:
    caching: Caching
    prefill_policy: Policy
    decode_policy: Policy
    pulls: bool = False  # name decodes that cache a longer prefix to a prefill that pulls
    write_back: WriteBackGate = field(default_factory=WriteBackGate)


class PrefillDecode(Strategy):
    """A prefill and a decode worker per request, with SGLang's bootstrap fields."""

    unit = "prefill/decode pair"

    def __init__(self, settings: PDSettings, registry: WorkerRegistry, sender: Sender) -> None:
        self.settings = settings
        self.policies = (settings.prefill_policy, settings.decode_policy)
        self.registry = registry
        self.sender = sender

    def kinds(self) -> tuple[WorkerType, ...]:
        return (WorkerType.PREFILL, WorkerType.DECODE)

    def pick(self, prompt: RouteRequest, tried: set[str]) -> tuple[Decision, Decision] | None:
        """One prefill by the prefill tree, one decode by the decode tree."""
        sides = []
        for kind in (WorkerType.PREFILL, WorkerType.DECODE):
            live = self.registry.available(kind, prompt.model)
            sides.append([w for w in live if w.url not in tried] or live)
        if not sides[0] or not sides[1]:
            return None
        picked = []
        for kind, side, policy in zip(
            (WorkerType.PREFILL, WorkerType.DECODE),
            sides,
            (self.settings.prefill_policy, self.settings.decode_policy),
            strict=True,
        ):
            prompt.type = kind
            picked.append(select_idle_first(policy, prompt, side, self.registry))
        return picked[0], picked[1]

    async def attempt(self, call: Call, tried: set[str]) -> Attempt | None:
        pair = self.pick(call.prompt, tried)
        if pair is None:
            return None
        p_dec, d_dec = pair
        prefill, decode = p_dec.worker, d_dec.worker
        caching, sender = self.settings.caching, self.sender
        keep_prefill = bool(call.body.get("return_logprob")) and not call.body.get("stream")
        # the prefill may pull a longer prefix from another prefill's or a decode's agent
        named = replace(p_dec, holders=self.prefill_holders(call.prompt, p_dec))
        extra = prefix_holders_field(named)
        write_back = caching.writeback and self._write_back(prefill, extra)
        body = {**call.body, **extra}
        payload, _room = bootstrap_payload(body, prefill)
        sender.metrics.pd_requests.inc()
        sender.metrics.event(PREFILL_REASON + p_dec.reason).inc()
        # in flight on the prefill from now, not from its task's first step: the next
        # admission by expected wait must see it (router.admission); a prefix it pulls
        # keeps its source counted as serving a pull as long
        counted = contextlib.ExitStack()
        if p_dec.pull_from is not None:
            counted.enter_context(p_dec.pull_from.serving_pull())
        pending = sender.pending(call.prompt, p_dec)
        counted.enter_context(prefill.request(pending, True, p_dec.load_s))
        p_task = asyncio.create_task(self._prefill(call, payload, p_dec, keep_prefill))
        p_task.add_done_callback(lambda _: counted.close())
        if caching.prefill_caches:
            sender.learner.record_soon(WorkerType.PREFILL, prefill, call.prompt)
        outcome = Outcome()
        d_tree = WorkerType.DECODE if caching.decode_caches else None
        d_task = asyncio.create_task(
            sender.relay(call, payload, d_dec, outcome, d_tree, side="decode")
        )
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if d_task not in done and p_task.result().error and not outcome.first_byte:
            # the decode would wait for KV that never comes: end it now, not at its timeout
            d_task.cancel()
            await asyncio.gather(d_task, return_exceptions=True)
            error = p_task.result().error or "prefill failed"
            sender.metrics.pd_errors.labels("prefill").inc()
            self.registry.record_failure(prefill)
            if outcome.client is not None:  # a stream had begun: end it with the error
                ended = await end_stream(outcome.client, error)
                return Attempt(ended, Outcome(status=502, error=error), [])
            raise RequestError(502, error)
        try:
            response = await d_task
        except AttemptFailed:
            p_task.cancel()
            await asyncio.gather(p_task, return_exceptions=True)
            raise
        result = await p_task
        if keep_prefill and result.body is not None and isinstance(response, Whole):
            response.body = merge_input_logprobs(result.body, response.body)
        served = [
            Served(prefill, WorkerType.PREFILL, p_dec.predicted_cached, result.cached_tokens),
            Served(decode, WorkerType.DECODE, d_dec.predicted_cached, None),
        ]
        served[0].error, served[0].side = result.error, "prefill"
        served[1].error, served[1].side = outcome.error, "decode"
        holders = []
        if caching.decode_caches:
            holders.append((WorkerType.DECODE, decode))
        if caching.writeback:
            self.settings.write_back.observe(prefill.url, write_back, result.written_back_tokens)
        if write_back:
            holders.append((WorkerType.PREFILL, prefill))
        return Attempt(response, outcome, served, holders)

    def _write_back(self, prefill: Worker, extra: dict[str, Any]) -> bool:
        """The gate's word for this request; a no is said to the decode in `extra`
        (`"memserve": {"write_back": false}`, which a real SGLang server ignores)."""
        decision = self.settings.write_back.ask(prefill.url)
        self.sender.metrics.write_backs.labels(decision).inc()
        if decision == "skipped":
            extra.setdefault("memserve", {})["write_back"] = False
            return False
        return True

    def prefill_holders(self, prompt: RouteRequest, decision: Decision) -> list[tuple[Worker, int]]:
        """The prefill decision's holders of a longer prefix, and with PD-Caching-2/3 (every
        prompt's KV stays cached on its decode) the decodes that hold one: the decodes' KV is
        as much again as the prefills', and a prefill that lacks a prefix pulls it from there
        instead of computing it. Longest first."""
        holders = list(decision.holders)
        prefill = decision.worker
        if not (self.settings.pulls and self.settings.caching.decode_caches and prefill.can_pull):
            return holders
        tokens, n = prompt.tokens, prompt.num_tokens
        if not tokens or n <= 1:
            return holders
        trees = self.sender.trees
        page = trees.page_size
        view = trees.match(WorkerType.DECODE, prompt.tree_key(tokens, page))
        for decode in self.registry.available(WorkerType.DECODE, prompt.model):
            held = reusable(view.held.get(decode.url, 0), n, page)
            if decode.agent is not None and held > decision.predicted_cached:
                holders.append((decode, held))
        holders.sort(key=lambda h: -h[1])
        return holders

    async def _prefill(
        self, call: Call, payload: bytes, decision: Decision, keep: bool
    ) -> PrefillResult:
        worker = decision.worker
        try:
            return await drain_prefill(
                self.sender.upstream,
                worker.url + call.route,
                payload,
                self.sender.timeout_s,
                keep,
                worker.exchanges,
            )
        finally:
            self.sender.metrics.for_worker(worker.url).inc()
