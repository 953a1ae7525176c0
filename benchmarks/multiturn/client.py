"""The load generator: one aiohttp session sends a workload's requests, streaming, causally.

Each request waits for its parent's answer, then for its arrival time (and the parent's
answer plus `gap_s`). TTFT is the time to the first chunk carrying content, JCT the time to
the end of the stream, TPOT (JCT - TTFT) / (completion tokens - 1). Requests go through
OpenAI's chat and completions routes, or SGLang's /generate (a chat rendered to text with
the model's template, as SGLang's own multi-turn benchmark sends it). Prompt, cached and
completion tokens come from the answer: OpenAI's usage in the last chunk, or SGLang's
meta_info, which also says where the cached tokens came from (device or host tier) and
how many were pulled from a peer. A request refused with 429 is sent again after the
server's Retry-After, a bounded number of times (`Retry429`); its TTFT and JCT count from
its first try, and `retries_429` says how many tries it took beyond that.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from benchmarks.multiturn.workloads import CHAT, OPENAI, SGLANG, Request, Workload

JSON_HEADERS = {"Content-Type": "application/json"}
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class Outcome:
    """What happened to one request."""

    rid: int
    session: str
    turn: int
    sent_s: float | None = None  # from the start of the run
    ttft_s: float | None = None
    jct_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Where the reused prompt tokens came from, when the answer says (None: it did not):
    # this instance's device and host tiers (cached_tokens = device + host), and a peer's
    # cache by a MemPool pull (not in cached_tokens).
    device_tokens: int | None = None
    host_tokens: int | None = None
    pulled_tokens: int | None = None
    # Of cached_tokens: on pages a decode wrote back to the prefill (PD-Caching-3).
    written_back_tokens: int | None = None
    answer: str = ""
    messages: list[dict[str, str]] | None = None  # chat: what was sent
    error: str | None = None
    retries_429: int = 0  # times the server refused it with 429 and it was sent again

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.jct_s is None or self.completion_tokens < 2:
            return None
        return (self.jct_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Retry429:
    """How a client answers a 429, as the OpenAI SDK does: wait the server's Retry-After
    (`default_wait_s` when it gives none it can read), then send again, at most
    `max_retries` times; a Retry-After beyond `max_wait_s` is not waited for (an error)."""

    max_retries: int = 3
    default_wait_s: float = 1.0
    max_wait_s: float = 60.0

    def wait_s(self, status: int, retry_after: str | None, retries: int) -> float | None:
        """Seconds to wait before the next try, or None: do not try again."""
        if status != 429 or retries >= self.max_retries:
            return None
        wait = parse_retry_after(retry_after)
        wait = self.default_wait_s if wait is None else wait
        return wait if wait <= self.max_wait_s else None


RETRY_429 = Retry429()


def parse_retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (delay-seconds, or an HTTP date from now); None when
    absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


@dataclass
class RunResult:
    outcomes: list[Outcome]
    wall_s: float
    first_sent_s: float
    last_done_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def body_for(
    request: Request,
    model: str,
    messages: list[dict[str, str]] | None,
    api: str = OPENAI,
    render: Callable[[list[dict[str, str]]], str] | None = None,
) -> bytes:
    """The request's body for `api`: OpenAI chat or completions, or SGLang's /generate with
    the chat rendered to text by `render` (the model's chat template), as SGLang's own
    multi-turn benchmark sends it."""
    if api == SGLANG:
        if messages is not None:
            if render is None:
                raise ValueError("SGLang's /generate needs the chat rendered: give `render`")
            text = render(messages)
        else:
            text = request.prompt or ""
        sampling = {"max_new_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True}
        return _encode({"text": text, "sampling_params": sampling, "stream": True})
    common = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.route == CHAT:
        # `user` names the session: our `session` policy sticks by it (X-Session-Id too).
        return _encode({**common, "messages": messages, "user": request.session})
    return _encode({**common, "prompt": request.prompt, "user": request.session})


def path_for(request: Request, api: str) -> str:
    if api == SGLANG:
        return "/generate"
    return "/v1/chat/completions" if request.route == CHAT else "/v1/completions"


@dataclass
class Stream:
    """What the chunks of one streamed answer said so far."""

    started: bool = False  # the server answered 200 and began streaming
    pieces: list[str] = field(default_factory=list)  # OpenAI: text deltas
    text: str = ""  # SGLang: the answer so far (each chunk carries all of it)
    usage: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None

    def take(self, chunk: dict[str, Any], chat: bool) -> bool:
        """Read one chunk; True when it carried answer content."""
        content = False
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                content = True
                self.pieces.append(piece)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("meta_info"), dict):
            self.meta = chunk["meta_info"]
            text = chunk.get("text")
            if isinstance(text, str) and (text or chunk.get("output_ids")):
                content, self.text = True, text
        return content

    def answer(self) -> str:
        return self.text or "".join(self.pieces)

    def finish(self, outcome: Outcome) -> str | None:
        """Token counts and the split into `outcome`; an error when the answer has none."""
        if self.meta is not None:  # SGLang: meta_info in every chunk, the last one final
            counts, details = self.meta, self.meta
        elif isinstance(self.usage, dict):
            counts, details = self.usage, self.usage.get("prompt_tokens_details") or {}
        else:
            return "no usage in the stream"
        outcome.prompt_tokens = int(counts.get("prompt_tokens") or 0)
        outcome.cached_tokens = int(details.get("cached_tokens") or 0)
        outcome.completion_tokens = int(counts.get("completion_tokens") or 0)
        read_split(outcome, [details, counts])
        finish = (self.meta or {}).get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":  # SGLang's abort
            return f"aborted by the engine: {str(finish.get('message'))[:200]}"
        return None


def messages_for(request: Request, parent: Outcome | None) -> list[dict[str, str]]:
    """This turn's chat: the parent's history and answer (when carried), then the user."""
    if parent is not None and request.carry and parent.messages is not None:
        history = [*parent.messages, {"role": "assistant", "content": parent.answer}]
    else:
        history = list(request.base or [])
    return [*history, {"role": "user", "content": request.user or ""}]


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    request: Request,
    outcome: Outcome,
    body: bytes,
    started: float,
    path: str,
    retry: Retry429 = RETRY_429,
) -> None:
    """Send one request (again after each 429 `retry` allows) and read its answer into
    `outcome`; TTFT and JCT count from the first try, as its user waited from then."""
    t0 = time.perf_counter()
    outcome.sent_s = t0 - started
    stream = Stream()
    try:
        while True:
            wait = await _try(session, url + path, body, request, outcome, stream, t0, retry)
            if wait is None:
                break
            outcome.retries_429 += 1
            await asyncio.sleep(wait)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if not stream.started:
        return  # refused: `outcome.error` says how
    outcome.jct_s = time.perf_counter() - t0
    outcome.answer = stream.answer()
    if outcome.error is not None:
        return
    outcome.error = stream.finish(outcome)
    if outcome.error is None and outcome.ttft_s is None:
        outcome.error = "no content in the stream"


async def _try(
    session: aiohttp.ClientSession,
    target: str,
    body: bytes,
    request: Request,
    outcome: Outcome,
    stream: Stream,
    t0: float,
    retry: Retry429,
) -> float | None:
    """One POST, its streamed answer read into `stream`: the seconds to wait before trying
    again after a 429 `retry` allows, else None (answered, or `outcome.error` says why
    not)."""
    chat = request.route == CHAT
    async with session.post(target, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            text = (await resp.read())[:300].decode(errors="replace")
            wait = retry.wait_s(resp.status, resp.headers.get("Retry-After"), outcome.retries_429)
            if wait is None:
                tries = f" (after {outcome.retries_429} retries)" if outcome.retries_429 else ""
                outcome.error = f"HTTP {resp.status}{tries}: {text}"
            return wait
        stream.started = True
        buffer = b""
        async for data in resp.content.iter_any():
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    continue
                chunk = _decode(payload)
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    outcome.error = f"stream error: {str(chunk['error'])[:200]}"
                if stream.take(chunk, chat) and outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - t0
    return None


def read_split(outcome: Outcome, places: Sequence[dict[str, Any]]) -> None:
    """The tier split, the pulled and the written-back tokens from the first of `places` that
    has each: `cached_tokens_details` {device, host} (SGLang's meta_info name),
    `pulled_tokens` and `written_back_tokens` (ours); OpenAI usage carries them in its
    prompt_tokens_details."""
    for place in places:
        tiers = place.get("cached_tokens_details")
        if isinstance(tiers, dict):
            outcome.device_tokens = int(tiers.get("device") or 0)
            outcome.host_tokens = int(tiers.get("host") or 0)
            break
    outcome.pulled_tokens = first_count(places, "pulled_tokens")
    outcome.written_back_tokens = first_count(places, "written_back_tokens")


def first_count(places: Sequence[dict[str, Any]], key: str) -> int | None:
    """`key` from the first of `places` that has it; None where none does."""
    for place in places:
        if place.get(key) is not None:
            return int(place[key])
    return None


async def run_workload(
    url: str,
    workload: Workload,
    model: str,
    on_done: Callable[[Outcome], None] | None = None,
    timeout_s: float = 600,
    render: Callable[[list[dict[str, str]]], str] | None = None,
    retry: Retry429 = RETRY_429,
    orphans: bool = False,
) -> RunResult:
    """Send every request of `workload` to `url` as its plan says, through the workload's
    API (`render` makes a chat's text for SGLang's /generate); `orphans`: a request whose
    parent failed is sent anyway at its own time, without the parent's messages (a request
    that carries its whole prompt, a trace row, does not need them), instead of not at all;
    wait for all answers (a 429 is tried again as `retry` says)."""
    requests = workload.requests
    outcomes = [Outcome(r.rid, r.session, r.turn) for r in requests]
    done = [asyncio.Event() for _ in requests]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()

        async def one(request: Request) -> None:
            outcome = outcomes[request.rid]
            try:
                parent = None
                not_before = request.at_s
                if request.parent is not None:
                    await done[request.parent].wait()
                    parent = outcomes[request.parent]
                    if not parent.ok and not orphans:
                        outcome.error = "not sent: its previous turn failed"
                        return
                    if not parent.ok:
                        parent = None
                    else:
                        assert parent.jct_s is not None and parent.sent_s is not None
                        not_before = max(not_before, parent.sent_s + parent.jct_s + request.gap_s)
                delay = not_before - (loop.time() - start_loop)
                if delay > 0:
                    await asyncio.sleep(delay)
                messages = None
                if request.route == CHAT:
                    messages = messages_for(request, parent)
                    outcome.messages = messages
                body = body_for(request, model, messages, workload.api, render)
                path = path_for(request, workload.api)
                await send_one(session, url, request, outcome, body, started, path, retry)
            finally:
                done[request.rid].set()
                if on_done is not None:
                    on_done(outcome)

        start_loop = loop.time()
        await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - started
    sent = [o.sent_s for o in outcomes if o.sent_s is not None]
    ends = [o.sent_s + o.jct_s for o in outcomes if o.sent_s is not None and o.jct_s is not None]
    return RunResult(outcomes, wall, min(sent, default=0.0), max(ends, default=wall))
