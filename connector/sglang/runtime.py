"""One server's MemPool and transfer agent, on a thread of their own.

SGLang calls its storage backend from several threads (prefetch, prefetch I/O, backup) while
our transfer agent serves peers on an asyncio loop and inserts what they push. MemPool is not
thread-safe, so every pool operation runs on the agent's loop thread; SGLang's threads only
copy bytes into or out of blocks that are theirs (just allocated) or pinned (matched with a
lock), outside the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from connector.sglang.config import BackendConfig, Peer
from connector.sglang.keys import KEY_TOKENS, key_tokens, page_spec
from mempool import MemPool, MemType, OutOfBlocks, PrefixMatch
from mempool.transfer import PeerInfo, TransferAgent

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class WritebackStats:
    """What the decode-to-prefill pushes did (summed over peers)."""

    batches: int = 0
    pages_sent: int = 0
    pages_skipped: int = 0  # the peer had them already: nothing travelled
    bytes: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)  # the last few, newest last


class PoolRuntime:
    """MemPool + TransferAgent for one SGLang rank; `close()` stops both."""

    def __init__(self, config: BackendConfig, page_bytes: int, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.page_bytes = page_bytes
        self.instance_id = config.instance_id + rank
        self.pool = MemPool(self.instance_id, page_spec(page_bytes), config.capacity_pages)
        self.peers = [
            Peer(p.instance_id + rank, p.host, p.port + rank) for p in config.writeback_peers
        ]
        self.writeback = WritebackStats()
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()  # guards _pending and writeback
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"mempool-hicache-{self.instance_id}", daemon=True
        )
        self._thread.start()
        port = config.port + rank if config.port else 0
        self.agent = TransferAgent(
            self.pool,
            host=config.host,
            port=port,
            secret=config.secret,
            timeout_s=config.timeout_s,
            allocate=self._allocate,
        )
        try:
            self.info = self.run(self.agent.start())
            for peer in self.peers:
                self.run(self.agent.add_peer(PeerInfo(peer.instance_id, peer.host, peer.port)))
        except BaseException:
            self._stop_loop()
            self.pool.close()
            raise
        self._sem: asyncio.Semaphore | None = None

    # ----------------------------------------------------------------- thread plumbing

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a plain function on the loop thread (where the pool may be touched)."""

        async def wrapper() -> T:
            return fn(*args)

        return self.run(wrapper())

    # ----------------------------------------------------------------- pool operations

    def _allocate(self, count: int, tier: MemType = MemType.HOST) -> list[int]:
        """Blocks for `count` pages, evicting least recently used cached pages if needed."""
        try:
            return self.pool.alloc_blocks(count, tier)
        except OutOfBlocks:
            free = self.pool.allocators[MemType.HOST].num_free
            self.pool.evict(count - free)
            return self.pool.alloc_blocks(count, tier)

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys the pool holds (SGLang's batch_exists)."""

        def count() -> int:
            for i, key in enumerate(keys):
                if self.pool.match(key_tokens(key)).num_tokens < KEY_TOKENS:
                    return i
            return len(keys)

        return self.call(count)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[list[PrefixMatch | None]]:
        """Each key's cached page (None for a miss), pinned for the block: safe to read off
        the loop thread while it lasts."""
        found = self._pin(keys)
        try:
            yield found
        finally:
            self._unpin(found)

    @contextlib.contextmanager
    def filling(self, keys: Sequence[str]) -> Iterator[list[int | None]]:
        """A fresh block for each key the pool lacks (None: cached already, or repeated), to
        fill in the block; indexed (and pushed to the writeback peers) when it ends, freed
        if it raises."""
        addrs = self._reserve(keys)
        try:
            yield addrs
        except BaseException:
            self._abort(addrs)
            raise
        self._commit(keys, addrs)

    def _pin(self, keys: Sequence[str]) -> list[PrefixMatch | None]:

        def pin_all() -> list[PrefixMatch | None]:
            out: list[PrefixMatch | None] = []
            for key in keys:
                found = self.pool.match(key_tokens(key), lock=True)
                if found.num_tokens < KEY_TOKENS:
                    self.pool.release(found)
                    out.append(None)
                else:
                    out.append(found)
            return out

        return self.call(pin_all)

    def _unpin(self, found: Sequence[PrefixMatch | None]) -> None:
        def release() -> None:
            for f in found:
                if f is not None:
                    self.pool.release(f)

        self.call(release)

    def _reserve(self, keys: Sequence[str]) -> list[int | None]:

        def alloc() -> list[int | None]:
            seen: set[str] = set()
            need: list[int] = []
            for i, key in enumerate(keys):
                if key in seen or self.pool.match(key_tokens(key)).num_tokens == KEY_TOKENS:
                    continue
                seen.add(key)
                need.append(i)
            out: list[int | None] = [None] * len(keys)
            if need:
                for i, addr in zip(need, self._allocate(len(need)), strict=True):
                    out[i] = addr
            return out

        return self.call(alloc)

    def _commit(self, keys: Sequence[str], addrs: Sequence[int | None]) -> None:
        pairs = [(k, a) for k, a in zip(keys, addrs, strict=True) if a is not None]

        def insert() -> None:
            for key, addr in pairs:
                self.pool.insert(key_tokens(key), [addr])  # a racing duplicate is freed

        self.call(insert)
        if pairs and self.peers:
            self._spawn_writeback([k for k, _ in pairs])

    def _abort(self, addrs: Sequence[int | None]) -> None:
        blocks = [a for a in addrs if a is not None]
        if blocks:
            self.call(self.pool.free_mem, blocks)

    def view(self, addr: int) -> memoryview:
        return self.pool.view_block(addr)

    def clear(self) -> int:
        """Drop every cached page; returns how many blocks were freed."""
        return len(self.call(self.pool.flush))

    def stats(self) -> dict[str, Any]:
        stats = self.call(self.pool.stats)
        with self._lock:
            wb = self.writeback
            stats["writeback"] = {
                "peers": [f"{p.instance_id}@{p.host}:{p.port}" for p in self.peers],
                **dataclasses.asdict(wb),
                "pending": len(self._pending),
            }
        stats["listen"] = f"{self.config.host}:{self.agent.port}"
        return stats

    # ----------------------------------------------------------------- writeback

    def _spawn_writeback(self, keys: list[str]) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._push_all(keys), self.loop)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)

    async def _push_all(self, keys: list[str]) -> None:
        await asyncio.gather(*(self._push(peer, keys) for peer in self.peers))

    async def _push(self, peer: Peer, keys: list[str]) -> None:
        """MemServe's PD-Caching-3: each page goes to the peer with transfer_with_insert, so
        the peer indexes it and pages it holds already do not travel. One call per page (a
        page is one key of its own there too), run concurrently over one connection."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.writeback_concurrency)
        sem = self._sem

        async def one(key: str) -> tuple[int, int, int]:
            async with sem:
                tokens = key_tokens(key)
                found = self.pool.match(tokens, lock=True)
                try:
                    if found.num_tokens < KEY_TOKENS:
                        return 0, 0, 0  # evicted here meanwhile: nothing to send
                    res = await self.agent.transfer_with_insert(
                        peer.instance_id, tokens, found.addrs
                    )
                    return res.pages_sent, res.pages_skipped, res.bytes
                finally:
                    self.pool.release(found)

        results = await asyncio.gather(*(one(k) for k in keys), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        with self._lock:
            wb = self.writeback
            wb.batches += 1
            for r in results:
                if isinstance(r, tuple):
                    wb.pages_sent += r[0]
                    wb.pages_skipped += r[1]
                    wb.bytes += r[2]
            if errors:
                wb.failures += len(errors)
                why = f"writeback to instance {peer.instance_id} ({peer.host}:{peer.port}) failed"
                wb.errors = [*wb.errors, f"{why}: {errors[0]}"][-8:]
                log.warning("%s for %d of %d pages: %s", why, len(errors), len(keys), errors[0])

    def drain(self, timeout: float | None = None) -> WritebackStats:
        """Wait until every writeback started so far has ended; returns the totals."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout)
        with self._lock:
            return dataclasses.replace(self.writeback, errors=list(self.writeback.errors))

    # ----------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        self.drain(timeout)
        try:
            self.run(self.agent.close(), timeout)
        finally:
            self._stop_loop()
            self.pool.close()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
