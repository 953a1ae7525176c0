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

from connector.pd_caching import Caching
from router.policies import Decision, Policy, RouteRequest
from router.proxy import Outcome, read_result
from router.upstream import UpstreamError, UpstreamPool
from router.workers import Worker, WorkerType

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
    if n is None:
        fields = {"bootstrap_host": host, "bootstrap_port": prefill.bootstrap_port}
        fields["bootstrap_room"] = room
    else:
        fields = {
            "bootstrap_host": [host] * n,
            "bootstrap_port": [prefill.bootstrap_port] * n,
            "bootstrap_room": [room + i for i in range(n)],
        }
    return msgspec.json.encode({**body, **fields}), room


async def drain_prefill(
    upstream: UpstreamPool, url: str, payload: bytes, timeout_s: float, keep_body: bool
) -> PrefillResult:
    """POST to the prefill instance and read its answer to the end (SSE included)."""
    out = PrefillResult()
    try:
        async with asyncio.timeout(timeout_s):
            resp = await upstream.post(url, payload)
            try:
                out.status = resp.status
                raw = await resp.read()
            finally:
                resp.release()
    except (UpstreamError, TimeoutError) as exc:
        out.error = f"prefill {url} failed: {exc or 'timed out'}"
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


def pick_pair(
    settings: PDSettings,
    request: RouteRequest,
    prefills: list[Worker],
    decodes: list[Worker],
) -> tuple[Decision, Decision]:
    """One prefill by the prefill tree, one decode by the decode tree."""
    request.type = WorkerType.PREFILL
    prefill = settings.prefill_policy.select(request, prefills)
    request.type = WorkerType.DECODE
    decode = settings.decode_policy.select(request, decodes)
    return prefill, decode
