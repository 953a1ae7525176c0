"""Forwarding one request to a worker: retries before the first byte, streams passed through.

The worker's bytes reach the client unchanged (SSE included, each chunk forwarded as it
arrives); alongside, the stream is parsed for what the trees need (cached_tokens, the
generated tokens or text). A worker that fails before answering is retried elsewhere with
backoff; one that dies mid-stream ends the client's stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from router.deadlines import deadlines
from router.forward.reply import ClientSide, Stream, Whole
from router.forward.upstream import UpstreamError, UpstreamPool, UpstreamResponse

_decode_json = msgspec.json.Decoder().decode  # several times faster than json.loads
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "content-encoding",
    "keep-alive",
    "date",
    "server",
}


@dataclass(slots=True)
class RetryConfig:
    """sglang-router's defaults: 5 retries, 50 ms x1.5 up to 30 s, 20 % jitter."""

    max_retries: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 30.0
    multiplier: float = 1.5
    jitter: float = 0.2
    enabled: bool = True

    def backoff(self, attempt: int) -> float:
        base = min(self.initial_backoff_s * self.multiplier**attempt, self.max_backoff_s)
        return base * (1 + random.uniform(-self.jitter, self.jitter))


@dataclass(slots=True)
class Outcome:
    """What came back, for the trees and the metrics."""

    status: int = 0
    cached_tokens: int | None = None
    pulled_tokens: int | None = None  # of the prompt, pulled from a peer (reported apart)
    completion_tokens: int | None = None  # as the answer's usage (or meta_info) counts them
    output_ids: list[int] | None = None
    output_text: str = ""
    first_byte: bool = False
    error: str | None = None
    streamed: bool = False
    client: Stream | None = None  # the client's stream, once it has begun


class Bound:
    """A deadline on an exchange with a worker (`asyncio.timeout_at(deadline)`, checked by
    the loop's one deadline timer: router.deadlines), registered in `watch` (the worker's
    exchanges in flight) while it runs, so that the worker's failed health checks can end
    it early."""

    __slots__ = ("_cm", "_deadline", "_deadlines", "_watch")

    def __init__(self, deadline: float, watch: set[asyncio.Timeout] | None) -> None:
        self._deadline = deadline
        self._watch = watch
        self._cm = asyncio.Timeout(None)
        self._deadlines = deadlines()

    async def __aenter__(self) -> asyncio.Timeout:
        await self._cm.__aenter__()
        self._deadlines.add(self._cm, self._deadline)
        if self._watch is not None:
            self._watch.add(self._cm)
        return self._cm

    async def __aexit__(self, *exc: Any) -> None:
        self._deadlines.discard(self._cm)
        if self._watch is not None:
            self._watch.discard(self._cm)
        await self._cm.__aexit__(*exc)  # raises TimeoutError when the deadline passed


def timed_out(url: str, deadline: float, timeout_s: float, what: str) -> str:
    """Why a bounded wait on a worker ended: its deadline, or its failed health checks."""
    if asyncio.get_running_loop().time() < deadline - 0.001:
        return f"worker {url} stopped answering (it failed its health checks)"
    return f"worker {url} {what} within {timeout_s} s"


class WorkerUnavailable(Exception):
    """Connecting to the worker failed or it answered with a retryable status."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


def reported_tokens(body: dict[str, Any], name: str, top: bool = False) -> int | None:
    """A token count an answer reports: OpenAI's `usage.prompt_tokens_details` (`top`:
    `usage` itself), else SGLang's `meta_info` (None where neither has it)."""
    usage = _dict(body.get("usage"))
    first = usage if top or usage is None else _dict(usage.get("prompt_tokens_details"))
    return _count(first, _dict(body.get("meta_info")), name)


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _count(first: dict[str, Any] | None, then: dict[str, Any] | None, name: str) -> int | None:
    """`name` as an int from `first`, else from `then`."""
    for where in (first, then):
        value = where.get(name) if where is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def read_result(body: Any, outcome: Outcome) -> None:
    """cached_tokens and the output from a finished (or last streamed) JSON body."""
    if not isinstance(body, dict):
        return
    usage, meta = _dict(body.get("usage")), _dict(body.get("meta_info"))
    if usage is not None or meta is not None:  # (as reported_tokens, each read once)
        details = None if usage is None else _dict(usage.get("prompt_tokens_details"))
        cached = _count(details, meta, "cached_tokens")
        if cached is not None:
            outcome.cached_tokens = cached
        pulled = _count(details, meta, "pulled_tokens")
        if pulled is not None:
            outcome.pulled_tokens = pulled
        generated = _count(usage, meta, "completion_tokens")
        if generated is not None:
            outcome.completion_tokens = generated
    if isinstance(body.get("output_ids"), list):
        outcome.output_ids = body["output_ids"]
    if isinstance(body.get("text"), str):
        outcome.output_text = body["text"]
    for choice in body.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") or {}
        if isinstance(message.get("content"), str):
            outcome.output_text = message["content"]
        elif isinstance(choice.get("text"), str) and not outcome.streamed:
            outcome.output_text = choice["text"]


class SSEWatcher:
    """Parses a passing SSE byte stream without altering it."""

    def __init__(self, outcome: Outcome, inspect: bool = True) -> None:
        self.outcome = outcome
        self.inspect = inspect  # parse events for the trees, or only watch for [DONE]
        self._buffer = b""
        self.done = False  # saw `data: [DONE]`: the worker finished the stream

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line == b"data: [DONE]":
                    self.done = True
                elif self.inspect and line.startswith(b"data: "):
                    with contextlib.suppress(msgspec.DecodeError):
                        self._apply(_decode_json(line[6:]))

    def _apply(self, body: Any) -> None:
        if not isinstance(body, dict):
            return
        out = self.outcome
        if isinstance(body.get("text"), str) and "meta_info" in body:  # /generate: cumulative
            read_result(body, out)
            return
        for choice in body.get("choices") or []:
            if isinstance(choice, dict):
                delta = choice.get("delta") or {}
                piece = delta.get("content") if isinstance(delta, dict) else None
                piece = piece if isinstance(piece, str) else choice.get("text")
                if isinstance(piece, str):
                    out.output_text += piece
        if body.get("usage"):
            read_result({"usage": body["usage"]}, out)


async def forward(
    upstream: UpstreamPool,
    client_side: ClientSide,
    url: str,
    payload: bytes,
    timeout_s: float,
    outcome: Outcome,
    on_first_byte: Callable[[], None],
    inspect: bool = True,
    watch: set[asyncio.Timeout] | None = None,
) -> Whole | Stream:
    """POST `payload` to `url` and relay the answer to `client_side`: a whole answer is
    returned for the server to write, a streamed one is written as it arrives.

    Raises WorkerUnavailable before anything reached the client (the caller may retry);
    afterwards, failures end the client's stream with an error event instead. `timeout_s`
    bounds the whole exchange, streaming included (sglang-router's --request-timeout-secs);
    `watch` (the worker's exchanges) lets its failed health checks end it sooner.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    resp: UpstreamResponse | None = None
    watcher: SSEWatcher | None = None
    try:
        async with Bound(deadline, watch):  # one deadline for the whole exchange
            try:
                resp = await upstream.post(url, payload)
            except UpstreamError as exc:
                raise WorkerUnavailable(f"cannot reach worker {url}: {exc}") from None
            outcome.status = resp.status
            headers = {k: v for k, v in resp.headers.items() if k not in HOP_HEADERS}
            if resp.status in RETRY_STATUSES:
                try:
                    text = (await resp.read()).decode(errors="replace")
                except UpstreamError:
                    text = ""
                raise WorkerUnavailable(
                    f"worker {url} answered {resp.status}: {text[:200]}", resp.status
                )
            kind = resp.headers.get("content-type", "application/json")
            if not kind.startswith("text/event-stream"):
                try:
                    body = await resp.read()
                except UpstreamError as exc:
                    raise WorkerUnavailable(f"worker {url} failed while answering: {exc}") from None
                on_first_byte()
                if resp.status == 200 and inspect:
                    with contextlib.suppress(msgspec.DecodeError):
                        read_result(_decode_json(body), outcome)
                return Whole(resp.status, body, headers)
            outcome.streamed = True
            client = outcome.client = await client_side.open_stream(resp.status, headers)
            watcher = SSEWatcher(outcome, inspect)
            try:
                async for chunk in resp.iter_chunks():
                    if not outcome.first_byte:
                        outcome.first_byte = True
                        on_first_byte()
                    await client.write(chunk)
                    watcher.feed(chunk)
            except UpstreamError as exc:
                outcome.error = f"worker {url} failed mid-stream: {exc}"
    except TimeoutError:
        if resp is None:
            why = timed_out(url, deadline, timeout_s, "gave no answer")
            raise WorkerUnavailable(why) from None
        if resp.status in RETRY_STATUSES:  # (its body did not come in time)
            raise WorkerUnavailable(f"worker {url} answered {resp.status}: ", resp.status) from None
        if outcome.client is None:
            why = timed_out(url, deadline, timeout_s, "did not finish its answer")
            raise WorkerUnavailable(why) from None
        outcome.error = timed_out(url, deadline, timeout_s, "did not finish")
    finally:
        if resp is not None:
            resp.release()
    client = outcome.client  # streamed: the stream has ended, one way or another
    assert client is not None and watcher is not None
    if outcome.error is None and not watcher.done:
        outcome.error = f"worker {url} closed the stream before it finished"
    if outcome.error is not None:
        return await end_stream(client, outcome.error)
    await client.write_eof()
    return client


async def end_stream(client: Stream, message: str) -> Stream:
    """End a client's SSE stream with an error event and [DONE]: a clear end, never a hang."""
    error = {"error": {"message": message, "type": "WorkerError", "code": 502}}
    with contextlib.suppress(ConnectionResetError):
        await client.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        await client.write_eof()
    return client
