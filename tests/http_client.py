"""Minimal blocking HTTP helpers for tests (real sockets, no client library magic)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(
    url: str,
    body: Any = None,
    method: str | None = None,
    raw: bytes | None = None,
    timeout: float = 60,
) -> tuple[int, Any]:
    """(status, parsed JSON or text) for a request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url,
        data=data,
        method=method or ("POST" if data else "GET"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    text = payload.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def stream(url: str, body: Any, timeout: float = 60) -> list[Any]:
    """The `data:` events of an SSE response, parsed; '[DONE]' kept as a string."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str) -> float:
    """A metric's value summed over its labels, from Prometheus text."""
    lines = [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]
    assert lines, f"{name} not exported"
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
