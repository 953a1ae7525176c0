"""The open-loop client: Poisson arrivals for a fixed time, one record per request.

Arrivals never wait for answers (a busy session is skipped, a new one started), so a slow
cluster shows as growing latency and queues, not as a lower offered rate. Every request is
checked: a 200 with a complete, well-formed answer (a stream ends with [DONE] after a
finish reason), a deliberately bad request answered 400 with a JSON error; anything else is
an error of a named kind, kept with its status and the start of its body.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchmarks.soak.workload import BAD_BODIES, CHAT, Mix, Session, Sessions
from localrun.processes import JSON_HEADERS

REQUEST_TIMEOUT_S = 120.0
BODY_CHARS = 500
# Outcomes that are what the client asked for, not failures of the cluster.
EXPECTED = ("bad_request_rejected", "abandoned")


@dataclass
class Record:
    """One request: when it started (seconds since the load began), what it was, how it went."""

    t: float
    api: str
    stream: bool
    kind: str  # normal | bad | abandon
    session: int
    turn: int
    outcome: str = "ok"  # ok | an EXPECTED kind | an error kind
    status: int | None = None
    ttft_s: float | None = None  # streams: the first chunk with content
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    body: str | None = None  # errors only: the start of what came back

    @property
    def error(self) -> bool:
        return self.outcome not in ("ok", *EXPECTED)


class BadAnswer(Exception):
    """The status was fine but the answer was not (its kind and a snippet)."""

    def __init__(self, kind: str, body: str) -> None:
        super().__init__(kind)
        self.kind = kind
        self.body = body


@dataclass
class Answer:
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None


def usage_of(answer: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) from an OpenAI usage or SGLang meta_info."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        return usage.get("prompt_tokens"), details.get("cached_tokens")
    meta = answer.get("meta_info")
    if isinstance(meta, dict):
        return meta.get("prompt_tokens"), meta.get("cached_tokens")
    return None, None


def parse_whole(api: str, payload: bytes) -> Answer:
    try:
        answer = json.loads(payload)
        if api == CHAT:
            text = answer["choices"][0]["message"]["content"]
            finish = answer["choices"][0]["finish_reason"]
        else:
            text = answer["text"]
            finish = answer["meta_info"]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BadAnswer("malformed_body", payload[:BODY_CHARS].decode(errors="replace")) from None
    if not isinstance(text, str) or finish is None:
        raise BadAnswer("incomplete_body", payload[:BODY_CHARS].decode(errors="replace"))
    prompt, cached = usage_of(answer)
    return Answer(text, prompt, cached, None)


async def read_stream(
    api: str, resp: aiohttp.ClientResponse, t0: float, abandon: bool
) -> Answer | None:
    """The SSE events up to [DONE]; None when `abandon` and the first chunk arrived (the
    caller closes the connection)."""
    text, finish, ttft, done = "", None, None, False
    prompt = cached = None
    last = b""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        last = data
        if data == b"[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            raise BadAnswer("malformed_event", data[:BODY_CHARS].decode(errors="replace")) from None
        if "error" in event:
            raise BadAnswer("stream_error", data[:BODY_CHARS].decode(errors="replace"))
        if ttft is None:
            ttft = time.perf_counter() - t0
            if abandon:
                return None
        try:
            if api == CHAT:
                choice = event["choices"][0] if event["choices"] else {}
                text += (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            else:
                text = event["text"]  # SGLang streams the text so far
                finish = event["meta_info"].get("finish_reason") or finish
        except (KeyError, IndexError, TypeError, AttributeError):
            raise BadAnswer("malformed_event", data[:BODY_CHARS].decode(errors="replace")) from None
        got = usage_of(event)
        if got[0] is not None:
            prompt, cached = got
    if not done or finish is None:
        raise BadAnswer("truncated_stream", last[:BODY_CHARS].decode(errors="replace"))
    return Answer(text, prompt, cached, ttft)


async def send(
    http: aiohttp.ClientSession, url: str, session: Session, record: Record, max_tokens: int
) -> str | None:
    """One turn; fills `record`; the answer's text, or None when there is none to keep."""
    body = session.body(record.stream, max_tokens)
    t0 = time.perf_counter()
    try:
        async with http.post(url + session.api, json=body) as resp:
            record.status = resp.status
            if resp.status != 200:
                payload = await resp.read()
                record.outcome = f"http_{resp.status}"
                record.body = payload[:BODY_CHARS].decode(errors="replace")
                return None
            if record.stream:
                answer = await read_stream(session.api, resp, t0, record.kind == "abandon")
            else:
                answer = parse_whole(session.api, await resp.read())
    except BadAnswer as exc:
        record.outcome, record.body = exc.kind, exc.body
        return None
    except TimeoutError:
        record.outcome = "timeout"
        return None
    except aiohttp.ClientError as exc:
        record.outcome, record.body = "connection", f"{type(exc).__name__}: {exc}"[:BODY_CHARS]
        return None
    record.e2e_s = time.perf_counter() - t0
    if answer is None:
        record.outcome = "abandoned"
        return None
    record.ttft_s = answer.ttft_s
    record.prompt_tokens, record.cached_tokens = answer.prompt_tokens, answer.cached_tokens
    return answer.text


async def send_bad(
    http: aiohttp.ClientSession, url: str, rng: random.Random, record: Record
) -> None:
    """A malformed body: it must get a 400 with a JSON error, nothing else."""
    route, payload = rng.choice(BAD_BODIES)
    record.api = route
    t0 = time.perf_counter()
    try:
        async with http.post(url + route, data=payload, headers=JSON_HEADERS) as resp:
            record.status = resp.status
            text = (await resp.read()).decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as exc:
        record.outcome, record.body = "connection", f"{type(exc).__name__}: {exc}"[:BODY_CHARS]
        return
    record.e2e_s = time.perf_counter() - t0
    try:
        json.loads(text)
        is_json = True
    except ValueError:
        is_json = False
    if resp.status == 400 and is_json:
        record.outcome = "bad_request_rejected"
    else:
        record.outcome = f"bad_request_got_{resp.status}"
        record.body = text[:BODY_CHARS]


@dataclass
class LoadResult:
    records: list[Record]
    offered: int
    sessions: int
    elapsed_s: float  # from the first arrival to the last answer


async def run_load(
    url: str,
    rps: float,
    duration_s: float,
    seed: int,
    on_record: Callable[[Record], None],
    mix: Mix | None = None,
    origin: float | None = None,
) -> LoadResult:
    """Poisson arrivals at `rps` for `duration_s` from `origin` (a time.perf_counter() value;
    default now), then wait for every answer."""
    mix = mix or Mix()
    rng = random.Random(seed)
    sessions = Sessions(mix, random.Random(seed + 1))
    records: list[Record] = []
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter() if origin is None else origin
        arrival = 0.0

        async def turn(session: Session, record: Record, max_tokens: int) -> None:
            try:
                text = await send(http, url, session, record, max_tokens)
                if text is not None:
                    session.answered(text)
                else:  # no answer to build on: the session ends here
                    session.turns_left = 0
            finally:
                session.busy = False
                on_record(record)

        async def bad(record: Record) -> None:
            try:
                await send_bad(http, url, rng, record)
            finally:
                on_record(record)

        while True:
            arrival += rng.expovariate(rps)
            if arrival >= duration_s:
                break
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            t = time.perf_counter() - start
            if rng.random() < mix.bad_share:
                record = Record(t, "", False, "bad", 0, 0)
                task = asyncio.create_task(bad(record))
            else:
                session = sessions.next()
                session.ask(rng)
                session.busy = True
                stream = rng.random() < mix.stream_share
                abandon = stream and rng.random() < mix.abandon_share
                kind = "abandon" if abandon else "normal"
                record = Record(t, session.api, stream, kind, session.id, session.turn)
                max_tokens = rng.randint(*mix.max_tokens)
                task = asyncio.create_task(turn(session, record, max_tokens))
            records.append(record)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return LoadResult(records, len(records), sessions.started, elapsed)
