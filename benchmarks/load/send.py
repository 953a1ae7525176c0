"""Send one request and read its answer, whole or streamed, into a `Record`.

An answer is complete when it is a 200 whose body names a finish reason (a stream: ended
with [DONE] after one); anything else is an error of a named kind, kept with the start of
what came back, so a benchmark can tell a refusal from a cut stream. TTFT is the time to the
first chunk carrying content; end to end the time to the end of the answer; both count from
the first try when a 429 is sent again, as its user waited from then. Answers of OpenAI's
chat and completions routes and of SGLang's /generate are read alike: text deltas or the
text so far, counts from the usage chunk or from meta_info.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from benchmarks.load.record import ABANDONED, REJECTED, Record
from benchmarks.load.retry import NO_RETRY, Retry429
from localrun.processes import JSON_HEADERS, auth_headers

DETAIL_CHARS = 500  # of a body or an event kept with an error
_decode = msgspec.json.Decoder().decode


class BadAnswer(Exception):
    """The status was fine but the answer was not: its kind and a snippet."""

    def __init__(self, kind: str, raw: bytes | str) -> None:
        super().__init__(kind)
        self.kind = kind
        text = raw if isinstance(raw, str) else raw[:DETAIL_CHARS].decode(errors="replace")
        self.detail = text[:DETAIL_CHARS]


async def send(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: Record,
    *,
    started: float | None = None,
    retry: Retry429 = NO_RETRY,
    need_usage: bool = False,
    api_key: str | None = None,
) -> None:
    """POST `body` to `url` + `record.path` and fill `record` (`sent_s` from `started`, a
    time.perf_counter() value, when given); `record.stream` says how to read the answer,
    `record.kind` whether to abandon it after its first chunk (`abandon`) or expect a 400
    (`bad`); `need_usage`: an answer without token counts is an error; `api_key`: sent as
    `Authorization: Bearer` (a tenant's key)."""
    t0 = time.perf_counter()
    if started is not None:
        record.sent_s = t0 - started
    headers = JSON_HEADERS if api_key is None else auth_headers(api_key)
    try:
        while (
            wait := await _try(http, url + record.path, body, record, t0, retry, headers)
        ) is not None:
            record.retries_429 += 1
            await asyncio.sleep(wait)
        if need_usage and record.ok and record.prompt_tokens == record.completion_tokens == 0:
            record.fail("no_usage", "no token counts in the answer")
    except BadAnswer as exc:
        record.fail(exc.kind, exc.detail)
    except TimeoutError:
        record.fail("timeout")
    except aiohttp.ClientError as exc:
        record.fail("connection", f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS])


async def _try(
    http: aiohttp.ClientSession,
    target: str,
    body: bytes,
    record: Record,
    t0: float,
    retry: Retry429,
    headers: dict[str, str] = JSON_HEADERS,
) -> float | None:
    """One POST and its answer: the seconds to wait before trying again after a 429 `retry`
    allows, else None (`record` says how it went)."""
    async with http.post(target, data=body, headers=headers) as resp:
        record.status = resp.status
        if record.kind == "bad":
            _judge_refusal(record, resp.status, await resp.read(), t0)
        elif resp.status != 200:
            payload = await resp.read()
            wait = retry.wait_s(resp.status, resp.headers.get("Retry-After"), record.retries_429)
            if wait is not None:
                return wait
            record.fail(f"http_{resp.status}", BadAnswer("", payload).detail)
        elif record.stream:
            await _read_stream(resp, record, t0)
        else:
            _read_whole(await resp.read(), record, t0)
    return None


def _judge_refusal(record: Record, status: int, payload: bytes, t0: float) -> None:
    """A malformed request must get a 400 with a JSON error, nothing else."""
    record.e2e_s = time.perf_counter() - t0
    try:
        _decode(payload)
        is_json = True
    except msgspec.DecodeError:
        is_json = False
    if status == 400 and is_json:
        record.fail(REJECTED)
    else:
        record.fail(f"bad_request_got_{status}", BadAnswer("", payload).detail)


def _read_whole(payload: bytes, record: Record, t0: float) -> None:
    record.e2e_s = time.perf_counter() - t0
    try:
        answer = _decode(payload)
        if isinstance(answer.get("meta_info"), dict):  # SGLang's /generate
            text, finish = answer["text"], answer["meta_info"].get("finish_reason")
        else:
            choice = answer["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            finish = choice.get("finish_reason")
    except (msgspec.DecodeError, AttributeError, KeyError, IndexError, TypeError):
        raise BadAnswer("malformed_body", payload) from None
    if not isinstance(text, str) or finish is None:
        raise BadAnswer("incomplete_body", payload)
    record.answer = text
    record.count(answer)
    _check_abort(finish)


async def _read_stream(resp: aiohttp.ClientResponse, record: Record, t0: float) -> None:
    """The SSE events up to [DONE]; an abandoned stream stops after its first event (the
    caller closes the connection)."""
    pieces: list[str] = []  # OpenAI: text deltas
    text = ""  # SGLang: each chunk carries the whole answer so far
    finish: Any = None
    counts: dict[str, Any] | None = None  # the last chunk with usage or meta_info
    done, last = False, b""
    async for data in _events(resp):
        last = data
        if data == b"[DONE]":
            done = True
            break
        try:
            chunk = _decode(data)
            if "error" in chunk:
                raise BadAnswer("stream_error", data)
            if record.kind == "abandon":
                record.e2e_s = time.perf_counter() - t0
                record.fail(ABANDONED)
                return
            content = False
            for choice in chunk["choices"] if "meta_info" not in chunk else ():
                delta = choice.get("delta")
                piece = (delta or {}).get("content") if "delta" in choice else choice["text"]
                finish = choice.get("finish_reason") or finish
                if piece:
                    content = True
                    pieces.append(piece)
            if isinstance(meta := chunk.get("meta_info"), dict):
                finish = meta.get("finish_reason") or finish
                counts = chunk
                if isinstance(chunk["text"], str) and (chunk["text"] or chunk.get("output_ids")):
                    content, text = True, chunk["text"]
            elif chunk.get("usage"):
                counts = chunk
        except (msgspec.DecodeError, AttributeError, KeyError, IndexError, TypeError):
            raise BadAnswer("malformed_event", data) from None
        if content and record.ttft_s is None:
            record.ttft_s = time.perf_counter() - t0
    record.e2e_s = time.perf_counter() - t0
    record.answer = text or "".join(pieces)
    if counts is not None:
        record.count(counts)
    if not done or finish is None:
        raise BadAnswer("truncated_stream", last)
    _check_abort(finish)
    if record.ttft_s is None:
        raise BadAnswer("empty_stream", "no content in the stream")


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each SSE `data:` line, as the bytes arrive."""
    buffer = b""
    async for data in resp.content.iter_any():
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()


def _check_abort(finish: Any) -> None:
    """SGLang's finish reason for a request its engine gave up on is an error."""
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise BadAnswer("aborted", f"aborted by the engine: {str(finish.get('message'))[:200]}")


def http_session(timeout_s: float) -> aiohttp.ClientSession:
    """A client session with no cap on connections: the load, not the client, sets the
    concurrency; `timeout_s` bounds each request."""
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    )


def send_now(url: str, data: bytes, record: Record, timeout_s: float = 120) -> Record:
    """`send` from synchronous code, one request at a time; RuntimeError unless answered."""

    async def one() -> None:
        async with http_session(timeout_s) as http:
            await send(http, url, data, record)

    asyncio.run(one())
    if not record.ok:
        raise RuntimeError(f"{url}{record.path}: {record.problem}")
    return record
