"""What router replicas tell each other: tree and registry operations, and snapshots.

Each replica keeps its prompt trees in memory and publishes the operations that change them
(record, drop, forget, clear), worker additions and removals, and its in-flight load per
worker; the others apply them.
Messages are msgpack (msgspec) with tokens packed as uint32 little-endian bytes, a version,
and a header (replica id, incarnation, sequence number) that lets a reader skip its own
messages and drop duplicates (a batch re-sent after a reply was lost). This module holds the
formats and the outbox only; Redis I/O lives in router.replicas.sync.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

VERSION = 1

# Operation kinds
RECORD = "record"
DROP = "drop"
FORGET = "forget"
CLEAR = "clear"
ADD_WORKER = "add_worker"
REMOVE_WORKER = "remove_worker"
LOAD = "load"  # the publisher's in-flight requests and prompt tokens per worker URL
KINDS = frozenset({RECORD, DROP, FORGET, CLEAR, ADD_WORKER, REMOVE_WORKER, LOAD})


class Op(msgspec.Struct, omit_defaults=True):
    """One operation as published; fields beyond the header depend on `op`."""

    v: int
    replica: str
    inc: int  # the publishing process's incarnation: a restarted replica starts a new one
    seq: int  # per incarnation, from 1
    op: str
    ts: float = 0.0  # wall clock when it was emitted: the readers' lag metric
    type: str = "colocated"  # WorkerType value: which tree, or the added worker's type
    url: str = ""
    tokens: bytes = b""  # uint32 little-endian
    keep: int = 0  # drop: tokens kept
    tier: str | None = None  # Tier value; drop with None: every tier
    bootstrap_port: int | None = None  # add_worker
    model_id: str | None = None  # add_worker: the model it was given (router.models)
    loads: dict[str, list[int]] | None = None  # load: URL -> [requests, prompt tokens]


class SnapshotEntry(msgspec.Struct, array_like=True):
    """`url` holds the whole path `tokens` in tree `type`, tier `tier`."""

    type: str
    url: str
    tier: str
    tokens: bytes


class WorkerEntry(msgspec.Struct, array_like=True):
    url: str
    type: str
    bootstrap_port: int | None = None
    model_id: str | None = None


class Snapshot(msgspec.Struct):
    """The trees' holders as one replica had them after applying the stream up to
    `stream_id` (a late replica applies it, then reads the stream from there)."""

    v: int
    replica: str
    stream_id: str
    created: float
    entries: list[SnapshotEntry] = []
    workers: list[WorkerEntry] = []


_encoder = msgspec.msgpack.Encoder()
_op_decoder = msgspec.msgpack.Decoder(Op)
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)
_BIG_ENDIAN = sys.byteorder == "big"


def pack_tokens(tokens: Sequence[int] | array[int]) -> bytes:
    """Token ids as uint32 little-endian bytes."""
    data = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if _BIG_ENDIAN:
        data = array("I", data)
        data.byteswap()
    return data.tobytes()


def unpack_tokens(raw: bytes) -> array[int]:
    """The inverse of pack_tokens; ValueError when `raw` is not whole uint32s."""
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} token bytes are not whole uint32s")
    data = array("I")
    data.frombytes(raw)
    if _BIG_ENDIAN:
        data.byteswap()
    return data


def encode(message: Op | Snapshot) -> bytes:
    return _encoder.encode(message)


def decode_op(raw: bytes) -> Op:
    """msgspec.DecodeError (a ValueError) for anything that is not an Op."""
    return _op_decoder.decode(raw)


def decode_snapshot(raw: bytes) -> Snapshot:
    return _snapshot_decoder.decode(raw)


@dataclass(slots=True)
class Dedupe:
    """Highest sequence number applied per (replica, incarnation): a repeat is skipped."""

    seen: dict[tuple[str, int], int] = field(default_factory=dict)

    def fresh(self, op: Op) -> bool:
        """True the first time an op is seen (and remembers it)."""
        key = (op.replica, op.inc)
        if op.seq <= self.seen.get(key, 0):
            return False
        self.seen[key] = op.seq
        return True


class Outbox:
    """This replica's operations waiting to be published: a bounded queue, never awaited by
    whoever emits (a full queue drops the newest op and counts it)."""

    def __init__(self, replica: str, inc: int, maxsize: int = 10_000) -> None:
        self.replica = replica
        self.inc = inc
        self.seq = 0
        self.dropped = 0
        self.queue: asyncio.Queue[Op] = asyncio.Queue(maxsize)

    def emit(self, op: str, **fields: Any) -> Op | None:
        """Queue one operation; None when the queue was full (dropped)."""
        self.seq += 1
        message = Op(VERSION, self.replica, self.inc, self.seq, op, ts=time.time(), **fields)
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped += 1
            return None
        return message

    def take(self, limit: int) -> list[Op]:
        """Up to `limit` queued ops, without waiting."""
        out: list[Op] = []
        while len(out) < limit and not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out
