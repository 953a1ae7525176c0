"""One request as its client saw it: the record every benchmark counts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OK = "ok"
ABANDONED = "abandoned"  # a stream the client closed after its first chunk, on purpose
REJECTED = "bad_request_rejected"  # a malformed request answered 400 with a JSON error
# Outcomes that are what the client asked for, not failures of the server.
EXPECTED = (OK, ABANDONED, REJECTED)


@dataclass
class Record:
    """The suite says what the request was (rid, session, turn, path, stream, kind); the
    sender says how it went. `outcome` is `ok`, an EXPECTED kind, or an error kind
    (`http_429`, `timeout`, `connection`, `truncated_stream`, ...) with `detail` saying more
    (the start of the body, the exception)."""

    rid: int = 0
    session: str | int = ""
    turn: int = 0
    path: str = ""
    stream: bool = False
    kind: str = "normal"  # normal | bad (must get a 400) | abandon (closed after a chunk)
    sent_s: float | None = None  # from the start of the run (the first try)
    status: int | None = None
    ttft_s: float | None = None  # streams: to the first chunk carrying content
    e2e_s: float | None = None  # to the end of the answer
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
    outcome: str = OK
    detail: str | None = None
    retries_429: int = 0  # times the server refused it with 429 and it was sent again

    @property
    def ok(self) -> bool:
        """A whole, well-formed answer."""
        return self.outcome == OK

    @property
    def failed(self) -> bool:
        """Neither an answer nor what the client asked for (an abandon, a 400)."""
        return self.outcome not in EXPECTED

    @property
    def problem(self) -> str | None:
        """`kind: detail` for a request that did not end ok; None for one that did."""
        if self.ok:
            return None
        return self.outcome if self.detail is None else f"{self.outcome}: {self.detail}"

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def fail(self, outcome: str, detail: str | None = None) -> None:
        self.outcome, self.detail = outcome, detail

    def count(self, answer: dict[str, Any]) -> None:
        """Token counts from an answer's OpenAI usage or SGLang meta_info (kept when it has
        neither); the tier split, pulled and written-back tokens from the first place that
        has each: `cached_tokens_details` {device, host} (SGLang's meta_info name),
        `pulled_tokens` and `written_back_tokens` (ours; OpenAI usage carries them in its
        prompt_tokens_details)."""
        meta, usage = answer.get("meta_info"), answer.get("usage")
        if isinstance(meta, dict):
            counts, details = meta, meta
        elif isinstance(usage, dict) and usage:
            counts, details = usage, usage.get("prompt_tokens_details") or {}
        else:
            return
        self.prompt_tokens = int(counts.get("prompt_tokens") or 0)
        self.cached_tokens = int(details.get("cached_tokens") or 0)
        self.completion_tokens = int(counts.get("completion_tokens") or 0)
        places = (details, counts)
        tiers = next(
            (t for p in places if isinstance(t := p.get("cached_tokens_details"), dict)), None
        )
        if tiers is not None:
            self.device_tokens = int(tiers.get("device") or 0)
            self.host_tokens = int(tiers.get("host") or 0)
        self.pulled_tokens = first_count(places, "pulled_tokens")
        self.written_back_tokens = first_count(places, "written_back_tokens")


def first_count(places: tuple[dict[str, Any], ...], key: str) -> int | None:
    """`key` from the first of `places` that has it; None where none does."""
    for place in places:
        if place.get(key) is not None:
            return int(place[key])
    return None
