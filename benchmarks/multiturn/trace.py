"""Replay of a trace in Mooncake's format (`timestamp` ms, `input_length`, `output_length`,
`hash_ids`: one id per 512-token block, equal leading ids meaning a shared prefix).

Sessions are rebuilt from the blocks: a request's parent is the latest earlier request that
shares at least its first two blocks with it (the first block is the system prompt every
request shares), so a conversation's turns form a chain. A subset is a seeded sample of whole
sessions (`sessions`), or the requests from `start` on (`requests`). Timestamps are scaled so
the subset is offered at `rate` requests/s; a turn is also never sent before its parent is
answered. Each block becomes deterministic text of exactly 512 tokens (`text.Vocab.block`).

The default trace ships with the package (`data/`, gzipped; its source and license are in
`data/README.md`), so a clone runs the benchmark as is; results name a trace by its
repository-relative path, never by where this machine keeps it.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.harness import shown_path
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import COMPLETION, Request, Workload

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRACE = DATA_DIR / "mooncake_conversation_trace.jsonl.gz"


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def open_text(path: Path) -> IO[str]:
    """A trace file for reading as text: gzipped (by its magic bytes) or plain."""
    with Path(path).open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8")
    return Path(path).open(encoding="utf-8")


def load_trace(path: Path) -> list[TraceRow]:
    """Rows in timestamp order, from a plain or gzipped file; ValueError naming the line for
    a malformed one."""
    rows = []
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append(
                    TraceRow(
                        float(obj["timestamp"]),
                        int(obj["input_length"]),
                        int(obj["output_length"]),
                        tuple(int(h) for h in obj["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{shown_path(path)}:{n}: not a Mooncake trace row ({exc})"
                ) from None
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


def parents(rows: list[TraceRow]) -> list[int | None]:
    """Each row's parent: the latest earlier row sharing at least its first two blocks."""
    owner: dict[tuple[int, ...], int] = {}
    out: list[int | None] = []
    for i, row in enumerate(rows):
        h, parent = row.hash_ids, None
        for k in range(len(h), 1, -1):
            parent = owner.get(h[:k])
            if parent is not None:
                break
        out.append(parent)
        for k in range(2, len(h) + 1):
            owner[h[:k]] = i
    return out


@dataclass(frozen=True)
class Clock:
    """Trace time to run time: the rows' timestamps scaled so they arrive at `rate`/s."""

    t0_ms: float
    span_s: float  # from the first row to the last, in trace seconds
    scale: float  # run seconds per trace second

    @classmethod
    def of(cls, rows: list[TraceRow], rate: float) -> Clock:
        t0 = rows[0].timestamp_ms
        span = max(rows[-1].timestamp_ms - t0, 1.0) / 1000
        return cls(t0, span, (len(rows) / rate) / span)

    def at_s(self, row: TraceRow) -> float:
        return (row.timestamp_ms - self.t0_ms) / 1000 * self.scale


@dataclass(frozen=True)
class TraceReplay:
    path: Path = DEFAULT_TRACE
    sessions: int = 150  # sampled whole sessions (0: use `requests` from `start`)
    requests: int = 0
    start: int = 0
    rate: float = 2.0  # offered requests/s after scaling the timestamps
    max_input_tokens: int = 32768  # longer requests are left out (CPU tokenizing cost)
    max_output_tokens: int = 512  # answers are capped here (CPU streaming cost)
    seed: int = 5

    def build(self, vocab: Vocab) -> Workload:
        rows = load_trace(self.path)
        parent = parents(rows)
        session = list(range(len(rows)))
        for i, p in enumerate(parent):
            if p is not None:
                session[i] = session[p]
        if self.sessions:
            roots = sorted(set(session))
            rng = random.Random(f"trace:{self.seed}")
            chosen = set(rng.sample(roots, min(self.sessions, len(roots))))
            keep = [i for i in range(len(rows)) if session[i] in chosen]
        else:
            keep = list(range(self.start, min(len(rows), self.start + (self.requests or 200))))
        keep = [i for i in keep if rows[i].input_length <= self.max_input_tokens]
        kept = set(keep)
        if not keep:
            raise ValueError(f"{shown_path(self.path)}: the subset is empty")
        clock = Clock.of([rows[i] for i in keep], self.rate)
        index = {row: n for n, row in enumerate(keep)}
        kept_parent: dict[int, int | None] = {}
        depth: dict[int, int] = {}
        for i in keep:  # ascending, so a parent is placed before its children
            p = parent[i]
            while p is not None and p not in kept:  # a dropped parent: take its parent
                p = parent[p]
            kept_parent[i] = p
            depth[i] = 0 if p is None else depth[p] + 1
        requests = []
        for i in keep:
            row = rows[i]
            text, ids = vocab.blocks_prompt(list(row.hash_ids), row.input_length, self.seed)
            p = kept_parent[i]
            requests.append(
                Request(
                    index[i],
                    f"trace{session[i]}",
                    depth[i],
                    clock.at_s(row),
                    max(1, min(row.output_length, self.max_output_tokens)),
                    COMPLETION,
                    None if p is None else index[p],
                    prompt=text,
                    prompt_ids=ids,
                )
            )
        subset = (
            f"{self.sessions} sampled sessions (seed {self.seed})"
            if self.sessions
            else f"rows {self.start}..{self.start + len(keep)}"
        )
        params = {
            **replay_params(self, len(rows), subset, requests, clock),
            "sessions": len({r.session for r in requests}),
        }
        return Workload(
            trace_name(self.path), f"trace replay ({Path(self.path).name})", requests, params
        )


def replay_params(
    replay: TraceReplay | OpenLoopTrace,
    rows: int,
    subset: str,
    requests: list[Request],
    clock: Clock,
) -> dict[str, Any]:
    """What the results say about a trace replay."""
    return {
        "trace": shown_path(replay.path),
        "trace_rows": rows,
        "subset": subset,
        "requests": len(requests),
        "rate": replay.rate,
        "time_scale": clock.scale,
        "trace_span_s": clock.span_s,
        "mean_input_tokens": sum(len(r.prompt_ids or []) for r in requests) / len(requests),
        "max_input_tokens": replay.max_input_tokens,
        "max_output_tokens": replay.max_output_tokens,
        "block_tokens": 512,
    }


def trace_name(path: Path) -> str:
    """`trace` for the shipped trace, else `trace:` and the file's name without suffixes."""
    if Path(path).resolve() == DEFAULT_TRACE:
        return "trace"
    return f"trace:{Path(path).name.split('.')[0]}"


@dataclass(frozen=True)
class OpenLoopTrace:
    """A Mooncake-format trace replayed as independent requests, open-loop: no session
    chaining, each row sent at its (scaled) timestamp whatever happened to the others, as a
    hot-prefix trace (tool and agent calls sharing long system prompts) is meant to be
    replayed. `requests` consecutive rows of at most `max_input_tokens`; seed k takes the
    k-th such window from `start` (the last whole one past the end), so paired seeds are
    other windows of the same trace; the seed also seeds the block text."""

    path: Path = DEFAULT_TRACE
    requests: int = 300
    start: int = 0
    rate: float = 2.0
    max_input_tokens: int = 32768
    max_output_tokens: int = 64
    seed: int = 1

    def build(self, vocab: Vocab) -> Workload:
        rows = [r for r in load_trace(self.path) if r.input_length <= self.max_input_tokens]
        if not rows:
            raise ValueError(f"{shown_path(self.path)}: no row of at most {self.max_input_tokens}")
        first = (self.start + (self.seed - 1) * self.requests) % len(rows)
        first = min(first, max(0, len(rows) - self.requests))  # a whole window: the last
        window = rows[first : first + self.requests]
        clock = Clock.of(window, self.rate)
        requests = []
        for n, row in enumerate(window):
            text, ids = vocab.blocks_prompt(list(row.hash_ids), row.input_length, self.seed)
            answer = max(1, min(row.output_length, self.max_output_tokens))
            requests.append(
                Request(
                    n, f"r{n}", 0, clock.at_s(row), answer, COMPLETION, prompt=text, prompt_ids=ids
                )
            )
        subset = f"rows {first}.. of those within max_input_tokens, {len(window)} requests"
        params = {
            **replay_params(self, len(rows), subset, requests, clock),
            "open_loop": True,
        }
        return Workload(
            trace_name(self.path), f"open-loop trace ({Path(self.path).name})", requests, params
        )
