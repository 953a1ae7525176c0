"""The prefill side of a PD request, in SGLang's wire format: the bootstrap fields added to
the client's body (arrays for a batch), the prefill's answer drained to its end, and its input
logprobs put in front of the decode's when the client asked for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.forward.relay import Bound, Outcome, read_result, reported_tokens, timed_out
from router.forward.upstream import UpstreamError, UpstreamPool
from router.workers import Worker

_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class PrefillResult:
    """The drained prefill answer: status, cached_tokens, and the body when wanted."""

    status: int = 0
    cached_tokens: int | None = None
    written_back_tokens: int | None = None  # of them, from pages a decode wrote back
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
        if isinstance(body, dict):
            out.written_back_tokens = reported_tokens(body, "written_back_tokens")
            if keep_body:
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
