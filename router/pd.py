"""PD disaggregation in the router: one prefill and one decode instance per request.

As sglang-router does it: pick a prefill instance (by the prefill tree) and a decode
instance (by the decode tree), add `bootstrap_host`, `bootstrap_port` and `bootstrap_room` to
the same JSON body, POST it to both at once; the client gets the decode's answer (streamed
as it comes), the prefill's is drained (its input logprobs are merged into a non-streamed
answer when asked for). The trees follow the caching mode the workers run (MemServe
table 4): which side caches the prompt, and whether decode output returns to prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from connector.pd_caching import Caching
from router.dispatch import Attempt, AttemptFailed, Call, Sender, Strategy
from router.learning import Served
from router.policies import Decision, Policy, RouteRequest
from router.proxy import Bound, Outcome, end_stream, read_result, timed_out
from router.request import RequestError
from router.upstream import UpstreamError, UpstreamPool
from router.workers import Worker, WorkerRegistry, WorkerType

_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class PDSettings:
    caching: Caching
    prefill_policy: Policy
    decode_policy: Policy


@dataclass(slots=True)
class PrefillResult:
    """The drained prefill answer: status, cached_tokens, and the body when wanted."""

    status: int = 0
    cached_tokens: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None


def batch_size(body: dict[str, Any]) -> int | None:
    """B for a batched /generate (a list of texts or of id lists), else None."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def bootstrap_payload(body: dict[str, Any], prefill: Worker) -> tuple[bytes, int]:
    """The body with SGLang's bootstrap fields (arrays for a batch); (payload, room)."""
    host = urlsplit(prefill.url).hostname or "127.0.0.1"
    room = random.getrandbits(63)
    n = batch_size(body)
    fields: dict[str, object]
    if n is None:
        fields = {
            "bootstrap_host": host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room,
        }
    else:
        fields = {
            "bootstrap_host": [host] * n,
            "bootstrap_port": [prefill.bootstrap_port] * n,
            "bootstrap_room": [room + i for i in range(n)],
        }
    return msgspec.json.encode({**body, **fields}), room


async def drain_prefill(
    upstream: UpstreamPool,
    url: str,
    payload: bytes,
    timeout_s: float,
    keep_body: bool,
    watch: set[asyncio.Timeout] | None = None,
) -> PrefillResult:
    """POST to the prefill instance and read its answer to the end (SSE included); `watch`:
    the instance's exchanges, ended early when it fails its health checks."""
    out = PrefillResult()
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with Bound(deadline, watch):
            resp = await upstream.post(url, payload)
            try:
                out.status = resp.status
                raw = await resp.read()
            finally:
                resp.release()
    except UpstreamError as exc:
        out.error = f"prefill {url} failed: {exc}"
        return out
    except TimeoutError:
        out.error = "prefill " + timed_out(url, deadline, timeout_s, "did not answer")
        return out
    if out.status != 200:
        message: Any = raw[:200]
        with contextlib.suppress(msgspec.DecodeError, AttributeError):
            message = _decode(raw).get("message") or message
        out.error = f"prefill {url} answered {out.status}: {message}"
        return out
    if raw.startswith(b"data:"):  # a streamed prefill answer: its last JSON event counts
        events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
        raw = next((e for e in reversed(events) if e and e != b"[DONE]"), b"{}")
    with contextlib.suppress(msgspec.DecodeError):
        body = _decode(raw)
        probe = Outcome()
        read_result(body, probe)
        out.cached_tokens = probe.cached_tokens
        if keep_body and isinstance(body, dict):
            out.body = body
    return out


def merge_input_logprobs(prefill: dict[str, Any], decode_raw: bytes) -> bytes:
    """sglang-router's rule: the prefill's input_token_logprobs go before the decode's."""
    try:
        decoded = _decode(decode_raw)
    except msgspec.DecodeError:
        return decode_raw
    if not isinstance(decoded, dict):
        return decode_raw
    theirs = (prefill.get("meta_info") or {}).get("input_token_logprobs")
    meta = decoded.get("meta_info")
    if isinstance(theirs, list) and isinstance(meta, dict):
        meta["input_token_logprobs"] = theirs + (meta.get("input_token_logprobs") or [])
    return msgspec.json.encode(decoded)


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
            live = self.registry.available(kind)
            sides.append([w for w in live if w.url not in tried] or live)
        if not sides[0] or not sides[1]:
            return None
        prompt.type = WorkerType.PREFILL
        prefill = self.settings.prefill_policy.select(prompt, sides[0])
        prompt.type = WorkerType.DECODE
        decode = self.settings.decode_policy.select(prompt, sides[1])
        return prefill, decode

    async def attempt(self, call: Call, tried: set[str]) -> Attempt | None:
        pair = self.pick(call.prompt, tried)
        if pair is None:
            return None
        p_dec, d_dec = pair
        prefill, decode = p_dec.worker, d_dec.worker
        caching, sender = self.settings.caching, self.sender
        keep_prefill = bool(call.body.get("return_logprob")) and not call.body.get("stream")
        payload, _room = bootstrap_payload(call.body, prefill)
        sender.metrics.pd_requests.inc()
        p_task = asyncio.create_task(self._prefill(call, payload, p_dec, keep_prefill))
        if caching.prefill_caches:
            sender.record_soon(WorkerType.PREFILL, prefill, call.prompt)
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
                response = await end_stream(outcome.client, error)
                return Attempt(response, Outcome(status=502, error=error), [])
            raise RequestError(502, error)
        try:
            response = await d_task
        except AttemptFailed:
            p_task.cancel()
            await asyncio.gather(p_task, return_exceptions=True)
            raise
        result = await p_task
        if keep_prefill and result.body is not None and isinstance(response, web.Response):
            assert isinstance(response.body, bytes)  # set from bytes by the relay
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
            holders.append((WorkerType.PREFILL, prefill))
        return Attempt(response, outcome, served, holders)

    async def _prefill(
        self, call: Call, payload: bytes, decision: Decision, keep: bool
    ) -> PrefillResult:
        worker = decision.worker
        try:
            with worker.request(self.sender.pending(call.prompt, decision)):
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
