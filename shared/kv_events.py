"""KV cache events in SGLang's wire format, so routers can learn an engine's exact cache.

ZMQ PUB multipart frames (topic, 8-byte big-endian sequence number, msgpack payload); the
payload is a KVEventBatch(ts, events) of array-like tagged structs BlockStored, BlockRemoved
and AllBlocksCleared, as SGLang and vLLM publish them. An optional ROUTER socket replays
buffered batches from a requested sequence number, ending with sequence -1.
Block hashes chain SHA-256 over (parent hash, page tokens), folded to a signed int64.
BlockStored and BlockRemoved end with SGLang's optional `medium` (the tier: "GPU",
"CPU_PINNED"); it is left off the wire when None, so decoders with or without the field read
both forms. A BlockStored of pages in a cache namespace (shared/namespaces.py) ends
with one more element, `metadata`, as SGLang's BlockStoredWithMetadata puts it after `medium`:
an array [cache_salt, extra_key, lora_name] (SGLang's BlockStoredMetadata has cache_salt
alone; the other two are ours, after it), and `lora_id` holds the adapter's id folded to a
signed int64. Its `block_hashes` chain over the namespace's index key, so equal tokens in two
namespaces never share a hash; `token_ids` are the real tokens. Decoders that know fewer
fields ignore the trailing ones (msgspec's array-like structs do), and events of pages in no
namespace are byte for byte what they were.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

# A replay ends with this sequence number (-1) and an empty payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union."""


class BlockStoredMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The namespace of stored pages: SGLang's `cache_salt`, then ours."""

    cache_salt: str | None = None  # None: the pages are not salted (a public prefix, or none)
    extra_key: str | None = None
    lora_name: str | None = None


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None  # SGLang's StorageMedium: "GPU", "CPU_PINNED"; None: GPU
    metadata: BlockStoredMetadata | None = None  # the cache namespace; None: none


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def page_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of every whole page of `tokens` (equal prefixes give equal hashes)."""
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in page)).digest()
        parent = digest
        hashes.append(int.from_bytes(digest[:8], "big", signed=True))
    return hashes


def publisher_binds(endpoint: str, bind: bool | None = None) -> bool:
    """Whether a publisher binds `endpoint` (rather than connecting to a listener there):
    `bind` when its config gives one, else SGLang 0.5.23's rule (ZmqEventPublisher.
    _socket_setup): a wildcard host (`*`, `0.0.0.0`, `::`) or a local transport binds, a
    concrete address connects. Routers use it to tell where a worker can be subscribed to."""
    if bind is not None:
        return bind
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


@dataclass(slots=True)
class KVEventsConfig:
    """SGLang's --kv-events-config JSON: publisher, endpoint, replay_endpoint, topic, ..."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    # SGLang's: bind (True) or connect (False) the PUB socket; None: publisher_binds' rule.
    # True binds a concrete address, e.g. loopback only.
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__) | {"max_queue_size"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
        raw.pop("max_queue_size", None)
        config = cls(**raw)
        if config.bind is not None and not isinstance(config.bind, bool):
            raise ValueError(f"--kv-events-config: bind must be true or false, not {config.bind!r}")
        if config.publisher not in {"null", "zmq"}:
            raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}")
        return config


class KVEventPublisher:
    """Publishes one batch per engine step (nothing when the step changed no cache state)."""

    def __init__(self, config: KVEventsConfig, page_size: int) -> None:
        self.page_size = page_size
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if publisher_binds(config.endpoint, config.bind):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: _ReplayServer | None = None
        if config.replay_endpoint:
            self._replay = _ReplayServer(self._ctx, config.replay_endpoint, self._buffered)
        self._pending: list[Any] = []

    def stored(
        self, tokens: Sequence[int], first_page: int, num_pages: int, medium: str | None = None
    ) -> None:
        """Pages first_page.. of `tokens` entered the cache (in tier `medium`)."""
        if num_pages <= 0:
            return
        hashes = page_hashes(tokens[: (first_page + num_pages) * self.page_size], self.page_size)
        ps = self.page_size
        self.moved(
            hashes[first_page:],
            hashes[first_page - 1] if first_page else None,
            list(tokens[first_page * ps : (first_page + num_pages) * ps]),
            medium,
        )

    def moved(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        medium: str | None,
        lora_id: int | None = None,
        metadata: BlockStoredMetadata | None = None,
    ) -> None:
        """Pages known by their hashes (and `parent`, the page before them) are now stored in
        tier `medium`: a swap between tiers, or new pages (in a namespace: `metadata`)."""
        if hashes:
            self._pending.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=self.page_size,
                    lora_id=lora_id,
                    medium=medium,
                    metadata=metadata,
                )
            )

    def removed(self, hashes: Iterable[int], medium: str | None = None) -> None:
        hashes = list(hashes)
        if hashes:
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """Send what this step produced as one batch."""
        if not self._pending:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=self._pending))
        self._pending = []
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        with self._buffer_lock:
            self._buffer.append((seq, payload))

    def _buffered(self, first: int) -> list[tuple[int, bytes]]:
        """The buffered batches from sequence number `first` on (for the replay thread)."""
        with self._buffer_lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= first]

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close()


class _ReplayServer:
    """The ROUTER socket that answers replay requests, on its own thread (as SGLang's
    publisher thread does): a subscriber that missed batches is answered at once, even
    while the engine is idle and publishes nothing."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        buffered: Callable[[int], list[tuple[int, bytes]]],
    ) -> None:
        self._buffered = buffered
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.bind(endpoint)  # bound here (errors reach the caller), used by the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-events-replay", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in self._buffered(max(start, 0)):
                self._sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._sock.send_multipart((client, b"", END_SEQ, b""))
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one published payload (for subscribers: routers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
