"""Exact tree updates from engines' KV events (SGLang's ZMQ format).

With --kv-events-bind the router binds one SUB socket; each worker publishes to it with its
own URL as the topic (SGLang's kv-events-config: {"publisher": "zmq", "endpoint":
"tcp://ROUTER:PORT", "topic": "http://WORKER:PORT"}); with --kv-events-subscribe every
replica subscribes to every worker (router.kv_events.subscriber). BlockStored names pages by
chained hashes plus their tokens, so the applier keeps, per worker, each page's parent and
tokens to rebuild the full prefix a hash stands for; BlockRemoved drops that prefix's tail
for the worker; AllBlocksCleared forgets the worker. SGLang's `medium` says which tier an
event is about (GPU, or CPU_PINNED for a host tier): a page swapped out to host is
BlockRemoved(GPU) then BlockStored(CPU_PINNED), and the trees follow it to the worker's host
tier; a page's record is kept while any tier holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from router.trees import PromptTrees, Tier
from router.workers import Worker, WorkerRegistry, WorkerType, normalize_url
from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoredMetadata,
    KVEventBatch,
)
from shared.namespaces import CacheNamespace

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pages:
    """One worker's pages by hash: (parent hash, the page's tokens, the tiers holding it)."""

    parent: dict[int, int | None] = field(default_factory=dict)
    tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    tiers: dict[int, set[Tier]] = field(default_factory=dict)
    # pages stored in a cache namespace: what their events said of it
    meta: dict[int, BlockStoredMetadata] = field(default_factory=dict)
    on_device: int = 0  # pages its device tier holds
    page_tokens: int = 0  # tokens a page (its events' block size)
    model: str = ""  # the tree namespace of the worker's model (router.models; "": default)

    def held_in(self, block_hash: int, tier: Tier) -> None:
        held = self.tiers.setdefault(block_hash, set())
        if tier is Tier.DEVICE and tier not in held:
            self.on_device += 1
        held.add(tier)

    def gone_from(self, block_hash: int, tier: Tier) -> None:
        """`tier` no longer holds the page; forget it once no tier does."""
        held = self.tiers.get(block_hash)
        if held is not None:
            if tier is Tier.DEVICE and tier in held:
                self.on_device -= 1
            held.discard(tier)
            if held:
                return
        self.tokens.pop(block_hash, None)
        self.parent.pop(block_hash, None)
        self.tiers.pop(block_hash, None)
        self.meta.pop(block_hash, None)

    def clear(self) -> None:
        self.parent.clear()
        self.tokens.clear()
        self.tiers.clear()
        self.meta.clear()
        self.on_device = 0

    def prefix(self, block_hash: int) -> list[int] | None:
        """All tokens from the root to the end of this page, keyed as the router keys a
        request in the pages' cache namespace (RouteRequest.tree_key); None if a link is
        unknown."""
        chain: list[int] = []
        current: int | None = block_hash
        while current is not None:
            if current not in self.tokens:
                return None
            chain.append(current)
            current = self.parent[current]
        chain.reverse()
        tokens = [t for h in chain for t in self.tokens[h]]
        if self.meta or self.model:
            namespace = self._namespace(chain)
            if namespace is not None:
                for start, ids in namespace.derived(tokens, self.page_tokens):
                    tokens[start : start + self.page_tokens] = ids
        return tokens

    def _namespace(self, chain: list[int]) -> CacheNamespace | None:
        """The namespace of a chain of pages: its keys from any page's metadata, its salt
        from the first salted page (the pages before it are a public prefix)."""
        metas = [self.meta.get(h) for h in chain]
        keyed = next((m for m in metas if m is not None), None)
        if keyed is None:
            return CacheNamespace(model=self.model) if self.model else None
        salted = ((i, m.cache_salt) for i, m in enumerate(metas) if m is not None and m.cache_salt)
        first, salt = next(salted, (0, None))
        return CacheNamespace.named(
            keyed.extra_key or "", keyed.lora_name, salt, first * self.page_tokens, self.model
        )


class KVEventApplier:
    """Turns workers' KV event batches into prompt-tree changes.

    `quiet` wraps every change: with replicas that each receive every worker's events
    (--kv-events-subscribe), a change learned from an event is not published to the others,
    who learn it from the same event.
    """

    def __init__(
        self,
        trees: PromptTrees,
        registry: WorkerRegistry,
        quiet: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.trees = trees
        self.registry = registry
        self.quiet = quiet
        self.pages: dict[str, _Pages] = {}
        # the tree namespace of a worker's model (router.models: set when it serves several)
        self.model_key: Callable[[Worker], str] = lambda _: ""
        self.batches = 0
        self.unknown_topics = 0

    def forget(self, url: str) -> None:
        """The worker's cache is gone (it restarted): forget its pages and holdings."""
        self.pages.pop(url, None)
        worker = self.registry.workers.get(url)
        if worker is not None:
            worker.free_tokens = -1  # until its events tell again
        with self.quiet():
            self.trees.forget(url)

    def apply(self, topic: str, batch: KVEventBatch) -> None:
        """Apply one batch published by the worker named by `topic`."""
        try:
            url = normalize_url(topic)
        except ValueError:
            url = topic
        worker = self.registry.workers.get(url)
        if worker is None:
            self.unknown_topics += 1
            return
        self.batches += 1
        pages = self.pages.setdefault(url, _Pages())
        pages.model = self.model_key(worker)
        with self.quiet():
            self._apply(url, worker.type, pages, batch)
        if worker.kv_capacity and pages.page_tokens:  # what a copy sent there would evict
            worker.free_tokens = max(worker.kv_capacity - pages.on_device * pages.page_tokens, 0)

    def _apply(self, url: str, type: WorkerType, pages: _Pages, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(url, type, pages, event)
            elif isinstance(event, BlockRemoved):
                tier = Tier.of_medium(event.medium)
                for block_hash in event.block_hashes:
                    tokens = pages.prefix(block_hash)
                    if tokens is not None:
                        keep = len(tokens) - len(pages.tokens[block_hash])
                        self.trees.drop(type, url, tokens, keep, tier)
                    pages.gone_from(block_hash, tier)
            elif isinstance(event, AllBlocksCleared):
                pages.clear()
                self.trees.forget(url)

    def _stored(self, url: str, type: WorkerType, pages: _Pages, event: BlockStored) -> None:
        size = event.block_size
        parent = event.parent_block_hash
        tier = Tier.of_medium(event.medium)
        pages.page_tokens = size
        for i, block_hash in enumerate(event.block_hashes):
            pages.parent[block_hash] = parent
            pages.tokens[block_hash] = tuple(event.token_ids[i * size : (i + 1) * size])
            if event.metadata is not None:
                pages.meta[block_hash] = event.metadata
            pages.held_in(block_hash, tier)
            parent = block_hash
        tokens = pages.prefix(parent) if parent is not None else None
        if tokens:
            self.trees.record(type, url, tokens, tier)


class KVEventListener:
    """One bound SUB socket every worker publishes to, each with its URL as the topic
    (--kv-events-bind: one router, or one replica that shares what it learns)."""

    def __init__(self, endpoint: str, applier: KVEventApplier) -> None:
        self.endpoint = endpoint
        self.applier = applier
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(endpoint)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)

    def info(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "batches": self.applier.batches,
            "unknown_topics": self.applier.unknown_topics,
        }

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            try:
                self.applier.apply(frames[0].decode(), self._decoder.decode(frames[2]))
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
                log.warning("undecodable KV event batch from %r", frames[0][:80])
