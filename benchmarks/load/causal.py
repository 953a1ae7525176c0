"""Causal sessions: each request waits for its parent's answer, then for its arrival time.

A multi-turn plan's request is sent at its `at_s` (from the start of the run), and not before
its parent's answer plus `gap_s`; a chat resends its parent's history and answer. Every
request is streamed and must report its token counts; a 429 is tried again as `Retry429`
says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.load.bodies import CHAT, COMPLETIONS, GENERATE, body
from benchmarks.load.record import Record
from benchmarks.load.retry import RETRY_429, Retry429
from benchmarks.load.send import http_session, send
from benchmarks.multiturn.workloads import CHAT as CHAT_ROUTE
from benchmarks.multiturn.workloads import SGLANG, Request, Workload

Render = Callable[[list[dict[str, str]]], str]


@dataclass
class RunResult:
    records: list[Record]  # by rid
    wall_s: float


def messages_for(request: Request, parent: Record | None) -> list[dict[str, str]]:
    """This turn's chat: the parent's history and answer (when carried), then the user."""
    if parent is not None and request.carry and parent.messages is not None:
        history = [*parent.messages, {"role": "assistant", "content": parent.answer}]
    else:
        history = list(request.base or [])
    return [*history, {"role": "user", "content": request.user or ""}]


def request_body(
    request: Request, record: Record, model: str, api: str, render: Render | None
) -> bytes:
    """The request's body for `api`, `record.path` set to its route: OpenAI chat or
    completions, or SGLang's /generate with the chat rendered to text by `render` (the
    model's chat template), as SGLang's own multi-turn benchmark sends it."""
    chat = request.route == CHAT_ROUTE
    prompt: list[dict[str, str]] | str = record.messages or [] if chat else request.prompt or ""
    if api == SGLANG:
        record.path = GENERATE
        if chat:
            if render is None:
                raise ValueError("SGLang's /generate needs the chat rendered: give `render`")
            prompt = render(record.messages or [])
    else:
        record.path = CHAT if chat else COMPLETIONS
    user = None if api == SGLANG else request.session
    return body(
        record.path,
        prompt,
        request.max_tokens,
        stream=True,
        model=None if api == SGLANG else model,
        ignore_eos=True,
        usage=True,
        user=user,
        lora_path=request.lora,
    )


async def run_workload(
    url: str,
    workload: Workload,
    model: str,
    on_done: Callable[[Record], None] | None = None,
    timeout_s: float = 600,
    render: Render | None = None,
    retry: Retry429 = RETRY_429,
    orphans: bool = False,
) -> RunResult:
    """Send every request of `workload` to `url` as its plan says, through the workload's
    API (`render` makes a chat's text for SGLang's /generate); `orphans`: a request whose
    parent failed is sent anyway at its own time, without the parent's messages (a request
    that carries its whole prompt, a trace row, does not need them), instead of not at all;
    wait for all answers."""
    requests = workload.requests
    records = [Record(r.rid, r.session, r.turn, stream=True) for r in requests]
    done = [asyncio.Event() for _ in requests]
    async with http_session(timeout_s) as session:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()

        async def one(request: Request) -> None:
            record = records[request.rid]
            try:
                parent = None
                not_before = request.at_s
                if request.parent is not None:
                    await done[request.parent].wait()
                    parent = records[request.parent]
                    if not parent.ok and not orphans:
                        record.fail("not_sent", "its previous turn failed")
                        return
                    if not parent.ok:
                        parent = None
                    else:
                        assert parent.e2e_s is not None and parent.sent_s is not None
                        not_before = max(not_before, parent.sent_s + parent.e2e_s + request.gap_s)
                delay = not_before - (loop.time() - start_loop)
                if delay > 0:
                    await asyncio.sleep(delay)
                if request.route == CHAT_ROUTE:
                    record.messages = messages_for(request, parent)
                data = request_body(request, record, model, workload.api, render)
                await send(
                    session,
                    url,
                    data,
                    record,
                    started=started,
                    retry=retry,
                    need_usage=True,
                    api_key=request.api_key,
                )
            finally:
                done[request.rid].set()
                if on_done is not None:
                    on_done(record)

        start_loop = loop.time()
        await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - started
    return RunResult(records, wall)
