"""Router processes on one host deciding on one state (`--processes N`): the local channel.

Every process (a sibling) keeps the whole state in memory, as one router does, and decides
alone: nothing on a request's path waits for another process. What changes that state is
passed on over Unix stream sockets in the router's private directory (each sibling listens
on one and connects to every other's), written and read by the event loop itself, in the
replicas' own formats (router.replicas.ops):

- tree operations (records, feedback drops, forgets, flushes) and workers added or removed
  through the API: `Op` messages, sent as they are emitted (`ReplicatedTrees` with an
  outbox that sends at once) and applied with `ReplicatedTrees.apply`;
- each sibling's in-flight requests and prompt tokens per worker, a millisecond after they
  change: a worker's load is its own count plus the siblings' last ones;
- the pieces of text each one encodes, with their token ids, so that all know every piece
  before any tree path made of it (sent first): what one process encoded the others
  match at once, as one router would;
- worker state, from sibling 0 alone, which alone checks health and reads the workers'
  load reports: its verdicts (unhealthy, healthy again) and every report it reads. A
  sibling whose request found a worker dead marks it dead at once and tells sibling 0,
  which decides for all.

KV events are not passed on: with --kv-events-subscribe every sibling subscribes to every
engine itself (the replicas' path). Siblings start together and wait for each other
(`start` returns once every one is connected to every other) before they serve; one that dies
takes the router down (router.supervisor), so no sibling ever joins late.

Why Unix sockets and not ZMQ: a ZMQ message goes through an I/O thread on each side, three
thread wake-ups per message where a socket write wakes only the reader; on a busy host
those hand-offs cost more than the rest of the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
import time
from array import array
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from router.replicas.ops import (
    ADD_WORKER,
    REMOVE_WORKER,
    VERSION,
    Op,
    Outbox,
    decode_op,
    encode,
)
from router.replicas.sync import set_peer_loads
from router.replicas.trees import ReplicatedTrees
from router.workers import Worker, WorkerRegistry, WorkerType
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)

LOAD_DELAY_S = 0.001  # in-flight counts are sent this soon after they change
CONNECT_RETRY_S = 0.02
READY_TIMEOUT_S = 60.0
OP, CONTROL, HELLO = b"o", b"c", b"h"
_HEADER = struct.Struct("<Ic")  # a frame: payload length, kind; then the payload


@dataclass(frozen=True, slots=True)
class SiblingConfig:
    """This process's place among the router's processes, and their private directory."""

    index: int
    count: int
    directory: Path

    @property
    def checks(self) -> bool:
        """Whether this process checks health and reads loads (one per router: the first)."""
        return self.index == 0

    def socket_path(self, index: int) -> str:
        return str(self.directory / f"sibling-{index}.sock")


class Control(msgspec.Struct, omit_defaults=True):
    """A message between siblings that is not a replicas' `Op`."""

    kind: str  # load | health | report | dead | pieces
    sender: int
    url: str = ""
    healthy: bool = True
    report: Any = None  # report: the worker's /v1/loads body as sibling 0 read it
    loads: dict[str, list[int]] = {}  # load: URL -> [requests, prompt tokens]
    # pieces: text, its token ids and, for a piece its encoder indexed (`PrefixIndex`), the
    # ids' character ends (native uint32; b"" when not indexed)
    pieces: list[tuple[str, bytes, bytes]] = []


def _ids(raw: bytes) -> array[int]:
    ids = array("I")
    ids.frombytes(raw)
    return ids


_control_decoder = msgspec.msgpack.Decoder(Control)
_control_encoder = msgspec.msgpack.Encoder()


class SendingOutbox(Outbox):
    """The replicas' outbox, sending each operation at once instead of queueing it."""

    def __init__(self, replica: str, inc: int, send: Callable[[bytes, bytes], None]) -> None:
        super().__init__(replica, inc, maxsize=1)
        self._send = send

    def emit(self, op: str, **fields: Any) -> Op | None:
        self.seq += 1
        message = Op(VERSION, self.replica, self.inc, self.seq, op, ts=time.time(), **fields)
        self._send(OP, encode(message))
        return message


class Siblings:
    """This process's side of the channel: sends what changed here, applies the others'."""

    def __init__(
        self,
        config: SiblingConfig,
        trees: ReplicatedTrees,
        registry: WorkerRegistry,
        on_worker_added: Callable[[Worker], Coroutine[Any, Any, None]],
        encoder: CachedEncoder | None = None,
    ) -> None:
        self.config = config
        self.index = config.index
        self.others = {i for i in range(config.count) if i != config.index}
        self.trees = trees
        self.registry = registry
        self.on_worker_added = on_worker_added
        self.encoder = encoder
        self.outbox = SendingOutbox(f"process-{config.index}", random.getrandbits(63), self.send)
        trees.outbox = self.outbox
        self.heard: set[int] = set()  # siblings connected to this one (their hello came)
        self._out: dict[int, asyncio.WriteTransport] = {}  # to each sibling
        self._server: asyncio.AbstractServer | None = None
        self._inbound: set[_Inbound] = set()
        self._ready = asyncio.Event()
        self._peer_loads: dict[int, dict[str, list[int]]] = {}
        self._last_load: dict[str, list[int]] | None = None
        self._load_timer: asyncio.TimerHandle | None = None
        self._following = False  # applying another process's change: not passed on again
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: list[bytes] = []  # frames to send this turn of the loop
        self.sent = self.applied = self.undecodable = 0
        if encoder is not None:
            encoder.on_store = self._pieces
        registry.when_load_changes(self._load_changed)
        registry.when_gone(self._gone)
        if config.checks:
            registry.when_back(lambda w: self._health(w, True))
            registry.when_reported(self._reported)

    # ----------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Listen, connect to every sibling, and return once every one is connected to
        every other (RuntimeError after `timeout_s`: a sibling did not come up)."""
        loop = asyncio.get_running_loop()
        path = self.config.socket_path(self.index)
        self._server = await loop.create_unix_server(lambda: _Inbound(self), path)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(self._connect(i) for i in sorted(self.others)))
                await self._ready.wait()
        except TimeoutError:
            missing = sorted(self.others - (self.heard & set(self._out)))
            why = f"router processes {missing} did not join within {timeout_s:g} s"
            raise RuntimeError(why) from None
        self._publish_load()

    async def _connect(self, index: int) -> None:
        """A connection to sibling `index` (retried until it listens), then a hello."""
        loop = asyncio.get_running_loop()
        path = self.config.socket_path(index)
        while True:
            try:
                transport, _ = await loop.create_unix_connection(asyncio.Protocol, path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(CONNECT_RETRY_S)
        transport.write(_frame(HELLO, str(self.index).encode()))
        self._out[index] = transport
        self._check_ready()

    def _check_ready(self) -> None:
        if self.heard >= self.others and set(self._out) >= self.others:
            self._ready.set()

    async def stop(self) -> None:
        if self._load_timer is not None:
            self._load_timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._flush()
        for transport in self._out.values():
            transport.close()
        for inbound in list(self._inbound):
            inbound.close()
        if self._server is not None:
            self._server.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Changes made inside come from another process: neither trees nor state are
        passed on again."""
        before, self._following = self._following, True
        try:
            with self.trees.applying():
                yield
        finally:
            self._following = before

    # ----------------------------------------------------------------- sending

    def send(self, kind: bytes, payload: bytes) -> None:
        """Queue one message; what a turn of the loop queues goes out in one write to each
        sibling (fewer writes and wake-ups than a message each), in order."""
        pending = self._pending
        if not pending:
            asyncio.get_running_loop().call_soon(self._flush)
        pending.append(_frame(kind, payload))
        self.sent += 1

    def _flush(self) -> None:
        frames, self._pending = self._pending, []
        if not frames:
            return
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        for transport in self._out.values():
            if not transport.is_closing():
                transport.write(data)

    def _control(self, message: Control) -> None:
        self.send(CONTROL, _control_encoder.encode(message))

    def worker_added(self, worker: Worker) -> None:
        """Added through this process's API: the siblings add it too."""
        port, model = worker.bootstrap_port, worker.model_id
        self.outbox.emit(
            ADD_WORKER, url=worker.url, type=worker.type.value, bootstrap_port=port, model_id=model
        )

    def worker_removed(self, url: str) -> None:
        self.outbox.emit(REMOVE_WORKER, url=url)

    def _load_changed(self) -> None:
        if self._load_timer is None and not self._following:
            loop = asyncio.get_running_loop()
            self._load_timer = loop.call_later(LOAD_DELAY_S, self._publish_load)

    def _publish_load(self) -> None:
        self._load_timer = None
        own = {w.url: [w.in_flight, w.in_flight_tokens] for w in self.registry.workers.values()}
        if own != self._last_load:
            self._control(Control("load", self.index, loads=own))
            self._last_load = own

    def _pieces(self, pieces: list[tuple[str, array[int]]]) -> None:
        """Pieces of text this process encoded: the siblings cache them too, so a piece is
        known to all before any tree path holding it is (sent first, on the same socket):
        a process knows whatever text a tree path it holds was made of, as one router."""
        ends = self.encoder.prefixes.ends if self.encoder is not None else lambda _: None
        sent = [
            (t, a.tobytes(), (e.tobytes() if (e := ends(t)) is not None else b""))
            for t, a in pieces
        ]
        self._control(Control("pieces", self.index, pieces=sent))

    def _gone(self, worker: Worker) -> None:
        """Unhealthy here: sibling 0 tells the others; another sibling found it dead on a
        request and tells sibling 0 (a removed worker: the removal tells all)."""
        if self._following or worker.url not in self.registry.workers:
            return
        if self.config.checks:
            self._health(worker, False)
        else:
            self._control(Control("dead", self.index, url=worker.url))

    def _health(self, worker: Worker, healthy: bool) -> None:
        if not self._following:
            self._control(Control("health", self.index, url=worker.url, healthy=healthy))

    def _reported(self, worker: Worker, report: object) -> None:
        message = Control("report", self.index, url=worker.url, healthy=worker.healthy)
        message.report = report
        self._control(message)

    # ----------------------------------------------------------------- receiving

    def _apply(self, kind: bytes, payload: bytes) -> None:
        if kind == OP:
            try:
                op = decode_op(payload)
            except ValueError:
                self.undecodable += 1
                return
            self.applied += 1
            if op.op == ADD_WORKER:
                self._add_worker(op)
            elif op.op == REMOVE_WORKER:
                with self.following(), contextlib.suppress(KeyError, ValueError):
                    self.registry.remove(op.url)
            else:
                self.trees.apply(op)
            return
        try:
            message = _control_decoder.decode(payload)
        except ValueError:
            self.undecodable += 1
            return
        self.applied += 1
        getattr(self, f"_on_{message.kind}", self._on_unknown)(message)

    def _add_worker(self, op: Op) -> None:
        try:
            worker = self.registry.add(op.url, WorkerType(op.type), op.bootstrap_port)
        except ValueError:  # already there, or malformed
            return
        worker.model_id = op.model_id
        self._spawn(self.on_worker_added(worker))

    def _on_unknown(self, message: Control) -> None:
        self.undecodable += 1

    def hello(self, inbound: _Inbound, payload: bytes) -> None:
        """A sibling connected: what comes on this connection is its."""
        try:
            sender = int(payload)
        except ValueError:
            sender = -1
        if sender not in self.others:
            self.undecodable += 1
            inbound.close()
            return
        self.heard.add(sender)
        self._check_ready()

    def _on_load(self, message: Control) -> None:
        self._peer_loads[message.sender] = message.loads
        set_peer_loads(self.registry, self._peer_loads.values())
        with self.following():
            self.registry.load_changed()

    def _on_health(self, message: Control) -> None:
        worker = self.registry.workers.get(message.url)
        if worker is not None and not self.config.checks:
            with self.following():
                self.registry.set_health(worker, message.healthy)

    def _on_report(self, message: Control) -> None:
        worker = self.registry.workers.get(message.url)
        if worker is None or self.config.checks:
            return
        with self.following():
            worker.ask_load()  # taken as asked now: the checking process read it just before
            worker.apply_load(message.report)
            if message.healthy != worker.healthy:
                self.registry.set_health(worker, message.healthy)

    def _on_pieces(self, message: Control) -> None:
        if self.encoder is not None:
            self.encoder.adopt(
                [(text, _ids(raw)) for text, raw, _ in message.pieces],
                [_ids(ends) if ends else None for _, _, ends in message.pieces],
            )

    def _on_dead(self, message: Control) -> None:
        worker = self.registry.workers.get(message.url)
        if worker is not None and self.config.checks:
            self.registry.mark_dead(worker)  # unhealthy here: _gone tells every sibling

    def lost(self, inbound: _Inbound) -> None:
        self._inbound.discard(inbound)
        if inbound.sender is not None and self._ready.is_set():  # stopping, or it died: the
            # supervisor stops the router then, and says so
            log.info("router process %d: sibling %d went away", self.index, inbound.sender)

    def info(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.config.count,
            "ready": self._ready.is_set(),
            "sent": self.sent,
            "applied": self.applied,
            "undecodable": self.undecodable,
            "checks_health": self.config.checks,
        }


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), kind) + payload


class _Inbound(asyncio.Protocol):
    """One sibling's connection to this process: frames parsed and applied as they come."""

    def __init__(self, siblings: Siblings) -> None:
        self.siblings = siblings
        self.sender: int | None = None
        self.transport: asyncio.BaseTransport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.siblings._inbound.add(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        size, at = len(buffer), 0
        header, unpack = _HEADER.size, _HEADER.unpack_from
        siblings = self.siblings
        while size - at >= header:
            length, kind = unpack(buffer, at)
            end = at + header + length
            if end > size:
                break
            payload = bytes(buffer[at + header : end])
            at = end
            if self.sender is None:
                if kind != HELLO:
                    siblings.undecodable += 1
                    self.close()
                    return
                siblings.hello(self, payload)
                self.sender = int(payload) if payload.isdigit() else -1
                continue
            try:
                siblings._apply(kind, payload)
            except Exception:  # one bad message must not stop the channel
                log.exception("router process %d: a sibling's message failed", siblings.index)
        del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self.siblings.lost(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
