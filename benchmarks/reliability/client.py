"""What a client sees of one request over a real socket, with a hard bound on its time: a
status and body, a transport error, or "hung". Nothing retries unless asked
(`until_answered`), so a retry the router made is told from one the client had to make."""

from __future__ import annotations

import http.client
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Seen:
    """One request's outcome as the client saw it."""

    status: int | None = None  # HTTP status; None: no response (transport error or hang)
    body: Any = None  # parsed JSON when it was JSON, else the text (truncated)
    error: str | None = None  # transport error, or the stream's error event's message
    hung: bool = False  # the bound passed with no end
    seconds: float = 0.0
    events: int = 0  # SSE data events read (streams)
    done: bool = False  # a stream ended with [DONE]
    attempts: int = 1  # requests the client sent (more than one: it retried)

    @property
    def ok(self) -> bool:
        """A whole answer: 200 and, for a stream, [DONE] without an error event."""
        return self.status == 200 and self.error is None and not self.hung

    @property
    def clear_error(self) -> bool:
        """A refusal that says why: a 4xx/5xx JSON body with a message, or a stream that
        ended with an error event and [DONE]."""
        if self.hung:
            return False
        if self.status is not None and self.status >= 400:
            return isinstance(self.body, dict) and isinstance(self.body.get("message"), str)
        return self.status == 200 and self.error is not None and self.done

    def summary(self) -> str:
        """Short, for the table: `200`, `502 'message...'`, `stream error`, `refused`."""
        if self.hung:
            return f"hung > {self.seconds:.0f} s"
        if self.status is None:
            return f"transport error: {(self.error or '')[:60]}"
        if self.status == 200 and self.error is not None:
            return f"200 stream then error event: {self.error[:60]}"
        if self.status >= 400:
            message = self.body.get("message") if isinstance(self.body, dict) else self.body
            return f"{self.status} {str(message)[:60]!r}"
        return "200"


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text[:300]


def post(
    url: str,
    body: Any = None,
    bound_s: float = 30.0,
    raw: bytes | None = None,
    method: str = "POST",
    on_event: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
) -> Seen:
    """One request; a stream (text/event-stream) is read to its end, `on_event(n)` called
    after the n-th data event (a scenario injects its fault there)."""
    target = urlsplit(url)
    payload = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    started = time.monotonic()
    seen = Seen()
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=bound_s)
    try:
        headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, target.path or "/", payload, headers)
        resp = conn.getresponse()
        seen.status = resp.status
        if resp.getheader("Content-Type", "").startswith("text/event-stream"):
            _read_stream(resp, seen, started, bound_s, on_event)
        else:
            seen.body = _decode(resp.read())
    except TimeoutError:
        seen.hung = True
    except (OSError, http.client.HTTPException) as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        seen.seconds = time.monotonic() - started
    return seen


def _read_stream(
    resp: http.client.HTTPResponse,
    seen: Seen,
    started: float,
    bound_s: float,
    on_event: Callable[[int], None] | None,
) -> None:
    """SSE lines to the end; an `{"error": ...}` event is the stream's error."""
    for line in resp:
        if time.monotonic() - started > bound_s:
            seen.hung = True
            return
        text = line.decode(errors="replace").strip()
        if not text.startswith("data: "):
            continue
        data = text[len("data: ") :]
        if data == "[DONE]":
            seen.done = True
            continue
        seen.events += 1
        event = _decode(data.encode())
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            seen.error = str(event["error"].get("message"))
            seen.body = event
        if on_event is not None:
            on_event(seen.events)


def until_answered(
    url: str, body: Any, deadline_s: float, bound_s: float = 30.0, pause_s: float = 0.2
) -> Seen:
    """A careful client: send again after a transport error or a 5xx until answered or
    `deadline_s` passes; the last try's outcome, with every try counted."""
    started = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        seen = post(url, body, bound_s)
        retryable = (seen.status is None and not seen.hung) or (seen.status or 0) >= 500
        if not retryable or time.monotonic() - started + pause_s > deadline_s:
            break
        time.sleep(pause_s)
    seen.attempts = attempts
    seen.seconds = time.monotonic() - started
    return seen


class Tally(list[Seen]):
    """Many requests' outcomes, counted the way the table shows them."""

    @property
    def ok(self) -> int:
        return sum(s.ok for s in self)

    @property
    def clear_errors(self) -> int:
        return sum(s.clear_error for s in self)

    @property
    def unclear(self) -> list[Seen]:
        """Neither an answer nor a clear error: a hang, a 5xx without JSON, a cut stream."""
        return [s for s in self if not (s.ok or s.clear_error)]

    @property
    def slowest_s(self) -> float:
        return max((s.seconds for s in self), default=0.0)

    def statuses(self) -> dict[str, int]:
        def key(s: Seen) -> str:
            if s.hung:
                return "hung"
            if s.status == 200 and s.error:
                return "stream error"
            return str(s.status or "transport error")

        return dict(sorted(Counter(map(key, self)).items()))
