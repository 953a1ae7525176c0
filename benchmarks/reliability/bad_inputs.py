"""Hostile and malformed requests and what each server must answer: one list for the fuzz
tests (tests/router/test_fuzz.py, tests/connector/test_worker_fuzz.py) and this table.
`status` is the router's exact answer (decided before any worker is touched); `worker` the
worker's own (None: any 4xx; 200: legal there, and served)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from benchmarks.reliability.client import post
from benchmarks.reliability.cluster import Cluster
from benchmarks.reliability.report import MAX_PAYLOAD, InputResult


@dataclass(frozen=True)
class BadInput:
    name: str
    route: str
    body: bytes
    status: int  # the router's answer
    says: str  # in the router's message
    worker: int | None = None  # the worker's answer; None: any 4xx
    router_only: bool = False


def chat_body(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


HOSTILE: list[BadInput] = [
    BadInput("invalid UTF-8", "/generate", b"\xff\xfe\x00garbage", 400, "not valid JSON"),
    BadInput("truncated JSON", "/generate", b'{"text": "a"', 400, "not valid JSON"),
    BadInput("JSON array, not object", "/generate", b"[]", 400, "JSON object"),
    BadInput("text is a number", "/generate", b'{"text": 5}', 400, "'text'"),
    BadInput("negative token id", "/generate", b'{"input_ids": [1, -2]}', 400, "token ids"),
    BadInput("messages is an object", "/v1/chat/completions", b'{"messages": {}}', 400, "messages"),
    BadInput(
        "role is a number", "/v1/chat/completions", b'{"messages": [{"role": 1}]}', 400, "role"
    ),
    BadInput("prompt is null", "/v1/completions", b'{"prompt": null}', 400, "prompt"),
    BadInput("lone surrogate", "/generate", b'{"text": "\\ud800"}', 400, "JSON"),
    BadInput(
        "unknown model",
        "/v1/chat/completions",
        chat_body(model="gpt-9"),
        404,
        "not found",
        worker=200,  # SGLang's server serves whatever `model` says; the router checks it
    ),
]

# Beyond the fuzz tests' list: the issue's other bad inputs.
MORE: list[BadInput] = [
    BadInput(
        "lone surrogate in a chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc80"}]}',
        400,
        "JSON",
    ),
    BadInput("lone surrogate prompt", "/v1/completions", b'{"prompt": "a\\ud800"}', 400, "JSON"),
    BadInput("empty messages", "/v1/chat/completions", b'{"messages": []}', 400, "non-empty"),
    BadInput("negative max_tokens", "/v1/chat/completions", chat_body(max_tokens=-1), 400, "max"),
    BadInput(
        "absurd max_tokens (1e12)",
        "/v1/chat/completions",
        chat_body(max_tokens=10**12),
        200,  # legal: capped at the context length, as SGLang does
        "",
        worker=200,
    ),
    BadInput(
        "prompt longer than the context",
        "/generate",
        json.dumps({"input_ids": [5] * 8192}).encode(),
        400,
        "context",
    ),
    BadInput(
        "body over the payload limit",
        "/generate",
        json.dumps({"text": "x" * (2 * MAX_PAYLOAD)}).encode(),
        413,
        "max-payload-size",
        router_only=True,
    ),
    BadInput(
        "max_new_tokens a string",
        "/generate",
        b'{"text": "a", "sampling_params": {"max_new_tokens": "ten"}}',
        400,
        "max_new_tokens",
    ),
]

CASES = HOSTILE + MORE


def check(case: BadInput, base_url: str, target: str) -> InputResult:
    """Send one case; judge the answer and whether the server still serves afterwards."""
    seen = post(base_url + case.route, raw=case.body, bound_s=30.0)
    message = seen.body.get("message", "") if isinstance(seen.body, dict) else str(seen.body)
    status = seen.status
    if target == "router":
        passed = status == case.status and (case.status == 200 or case.says in str(message))
        expected = f"{case.status}" + (
            f" '{case.says}'" if case.says and case.status != 200 else ""
        )
    elif case.worker is None:
        passed, expected = 400 <= (status or 0) < 500, "any 4xx"
    else:
        passed, expected = status == case.worker, str(case.worker)
    if passed and status is not None and status >= 400:
        passed = seen.clear_error  # a JSON body with a message
    serving = post(base_url + "/health", method="GET", bound_s=10.0).status == 200
    said = str(message) if status != 200 else "(answered)"
    return InputResult(case.name, target, case.route, status, said, expected, passed, serving)


def bad_inputs(c: Cluster) -> list[InputResult]:
    """Every case to a router (with the payload limit) and, unless router-only, its worker."""
    (worker,) = c.workers(1)
    router = c.colocated_router([worker], "--max-payload-size", str(MAX_PAYLOAD))
    out = []
    for case in CASES:
        out.append(check(case, router.url, "router"))
        if not case.router_only:
            out.append(check(case, worker.url, "worker"))
    return out
