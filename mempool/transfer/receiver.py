"""The serving side of the control plane: allocate, insert, lock and release for peers.

Every allocation or lock made for a peer belongs to that peer's control session until the
transfer commits or the lock is released. When the session ends (the connection drops or
membership says the peer died) everything it still holds is freed (MemServe 4.4: no memory
leaks when an instance fails), and a transfer or lock a live peer holds past
`pending_timeout_s` is freed on its own. Data-plane grants are revoked first, so no late
byte lands in a block that is back on the free list.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any

from mempool.address import MemType
from mempool.errors import InvalidAddress, InvalidRequest, MemPoolError
from mempool.pool import InsertFlags, MemPool, PrefixMatch
from mempool.radix import InsertResult
from mempool.transfer import messages as m
from mempool.transfer.grants import Grants
from mempool.transfer.plan import KVGeometry

log = logging.getLogger(__name__)


class TransferFlags(IntFlag):
    """`flags` of transfer / transfer_with_insert / pull: behaviour at the destination."""

    NONE = 0
    DST_HOST = 1  # allocate destination blocks in the host tier
    DST_DEVICE = 2  # ... in the device tier (default: device when the receiver has one)
    LOCK = 4  # keep the inserted prefix locked for a running request (release it later)
    NO_MERGE = 8  # one network call per block run: to measure what merging saves


@dataclass(slots=True)
class Received:
    """What arrived for the engine: which blocks hold which request's KV (`private`).

    `addrs` covers every page of the request, cached prefix first. When `inserted`, the whole
    pages are in the index (and locked when LOCK was asked: `lock` releases them with
    `pool.release`); a partial last page's block, and every block of a plain transfer, now
    belongs to the engine, which frees or inserts it.
    """

    peer_id: int
    xfer: int
    private: Any
    num_tokens: int
    tokens: array[int] | None
    addrs: list[int]
    cached_pages: int
    inserted: bool
    lock: InsertResult | None = None


OnReceived = Callable[[Received], Awaitable[None] | None]


def destination_tier(pool: MemPool, flags: int) -> MemType:
    """Where incoming KV goes: the tier the flags name, else device memory when there is some."""
    if flags & TransferFlags.DST_DEVICE:
        return MemType.DEVICE
    if flags & TransferFlags.DST_HOST or MemType.DEVICE not in pool.allocators:
        return MemType.HOST
    return MemType.DEVICE


@dataclass(eq=False)
class _Pending:
    xfer: int
    num_tokens: int
    tokens: array[int] | None
    addrs: list[int]
    allocated: list[int]  # what the receiver allocated and frees if the transfer dies
    granted: list[tuple[int, int]]
    match: PrefixMatch | None
    flags: int
    private: Any
    insert: bool
    since: float


@dataclass(eq=False)
class _Held:
    match: PrefixMatch
    granted: list[tuple[int, int]]
    since: float


@dataclass(eq=False)
class Session:
    """One authenticated control connection from a peer and everything it holds here."""

    peer_id: int
    close: Callable[[], None]
    transfers: dict[int, _Pending] = field(default_factory=dict)
    locks: dict[int, _Held] = field(default_factory=dict)


class Receiver:
    """Handles peers' requests against the local pool; owns sessions, grants and arrivals."""

    def __init__(
        self,
        pool: MemPool,
        geometry: KVGeometry,
        grants: Grants,
        on_received: OnReceived | None = None,
        pending_timeout_s: float = 60.0,
        backlog: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        allocate: Callable[[int, MemType], list[int]] | None = None,
    ) -> None:
        self.pool = pool
        # How blocks for incoming KV are found: the pool's free list, or an engine's
        # allocator that evicts its least recently used cache (and says so in its KV events).
        self.allocate = allocate or pool.alloc_blocks
        self.geometry = geometry
        self.grants = grants
        self.on_received = on_received
        self.pending_timeout_s = pending_timeout_s
        self.clock = clock
        self.sessions: set[Session] = set()
        # Pulls served: prefixes locked for a peer to read, and their tokens (the peer reads
        # the part of them it lacks).
        self.pulls_served = 0
        self.pull_tokens_locked = 0
        self._arrivals: deque[Received] = deque(maxlen=backlog)
        self._waiters: list[tuple[Callable[[Received], bool], asyncio.Future[Received]]] = []
        self._tasks: set[asyncio.Future[None]] = set()

    # ----------------------------------------------------------------- dispatch

    def handle(self, session: Session, msg: m.Message) -> m.Reply:
        rid = getattr(msg, "rid", 0)
        try:
            if isinstance(msg, m.Prepare):
                return self._prepare(session, msg)
            if isinstance(msg, m.Commit):
                return self._commit(session, msg)
            if isinstance(msg, m.Abort):
                pending = session.transfers.pop(msg.xfer, None)
                if pending is not None:
                    self._discard(session, pending)
                return m.Done(rid)
            if isinstance(msg, m.Lock):
                return self._lock(session, msg)
            if isinstance(msg, m.Unlock):
                held = session.locks.pop(msg.lock_id, None)
                if held is None:
                    raise InvalidRequest(f"no lock {msg.lock_id} is held for this peer")
                self._unlock(session, held)
                return m.Done(rid)
            raise InvalidRequest(f"unexpected {type(msg).__name__} on a control connection")
        except (MemPoolError, ValueError) as exc:
            return m.Refused(rid, type(exc).__name__, str(exc))
        except Exception as exc:  # a bug here must not take the connection down silently
            log.exception("receiver: %s failed", type(msg).__name__)
            return m.Refused(rid, "TransferFailed", f"internal error: {exc!r}")

    # ----------------------------------------------------------------- transfer steps

    def _tier(self, flags: int) -> MemType:
        return destination_tier(self.pool, flags)

    def _prepare(self, session: Session, msg: m.Prepare) -> m.Prepared:
        if msg.xfer in session.transfers:
            raise InvalidRequest(f"transfer {msg.xfer} is already in progress")
        geo, n = self.geometry, msg.num_tokens
        if n <= 0:
            raise InvalidRequest(f"num_tokens must be positive, got {n}")
        tokens = None
        if msg.tokens is not None:
            tokens = array("I")
            tokens.frombytes(msg.tokens)
            if len(tokens) != n:
                raise InvalidRequest(f"{len(tokens)} tokens sent for num_tokens={n}")
        if msg.insert and tokens is None:
            raise InvalidRequest("transfer_with_insert needs tokens")
        bpp, pages = geo.blocks_per_page, geo.pages_for(n)
        match = None
        if msg.dst_addrs is not None:
            addrs, allocated, cached = list(msg.dst_addrs), [], 0
            if len(addrs) != pages * bpp:
                raise InvalidRequest(
                    f"{n} tokens need {pages} pages x {bpp} blocks = {pages * bpp} destination "
                    f"addresses here, got {len(addrs)}"
                )
            self._check_writable(addrs)
        else:
            if msg.insert and tokens is not None:  # (insert without tokens was refused above)
                match = self.pool.match(tokens, lock=True)
            cached = match.num_tokens // geo.page_size if match else 0
            try:
                need = (pages - cached) * bpp
                # ascending, so that runs of blocks are contiguous bytes and merge into one call
                allocated = sorted(self.allocate(need, self._tier(msg.flags))) if need else []
            except BaseException:
                if match is not None:
                    self.pool.release(match)
                raise
            addrs = (match.addrs if match else []) + allocated
        offsets = map(self.pool.offset_of, addrs[cached * bpp :])
        granted = [(int(t), off) for t, off in offsets]
        self.grants.grant(session.peer_id, "write", granted)
        session.transfers[msg.xfer] = _Pending(
            msg.xfer,
            n,
            tokens,
            addrs,
            allocated,
            granted,
            match,
            msg.flags,
            msg.private,
            msg.insert,
            self.clock(),
        )
        return m.Prepared(msg.rid, addrs, cached)

    def _check_writable(self, addrs: list[int]) -> None:
        """Named destination blocks must be allocated here and not cached in the index."""
        if len(set(addrs)) != len(addrs):
            raise InvalidRequest("dst_addrs names a block twice")
        for addr in addrs:
            self.pool.offset_of(addr)  # raises InvalidAddress for blocks not allocated here
            if self.pool.is_indexed(addr):
                raise InvalidAddress(
                    f"destination block {addr:#x} holds cached KV; writing it would corrupt "
                    "the index"
                )

    def _commit(self, session: Session, msg: m.Commit) -> m.Committed:
        pending = session.transfers.pop(msg.xfer, None)
        if pending is None:
            raise InvalidRequest(
                f"transfer {msg.xfer} is unknown here (aborted, or expired after "
                f"{self.pending_timeout_s}s)"
            )
        self.grants.revoke(session.peer_id, "write", pending.granted)
        pending.granted = []
        lock = None
        addrs = pending.addrs
        # (read before the insert, which releases the match)
        cached_pages = pending.match.num_tokens // self.geometry.page_size if pending.match else 0
        if pending.insert:
            try:
                lock, addrs = self._insert(pending)
            except BaseException:
                self._discard(session, pending)
                raise
        self._arrived(
            Received(
                session.peer_id,
                pending.xfer,
                pending.private,
                pending.num_tokens,
                pending.tokens,
                addrs,
                cached_pages,
                pending.insert,
                lock,
            )
        )
        return m.Committed(msg.rid, addrs)

    def _insert(self, p: _Pending) -> tuple[InsertResult | None, list[int]]:
        """Index the whole pages; the canonical addresses (another transfer may have won)."""
        geo = self.geometry
        whole = p.num_tokens // geo.page_size
        bpp = geo.blocks_per_page
        lock = None
        assert p.tokens is not None
        try:
            if whole:
                flags = InsertFlags.LOCK if p.flags & TransferFlags.LOCK else InsertFlags.NONE
                head = p.tokens[: whole * geo.page_size]
                result = self.pool.insert(head, p.addrs[: whole * bpp], flags)
                lock = result if flags & InsertFlags.LOCK else None
                cached = self.pool.match(head).addrs
            else:
                cached = []
        finally:
            if p.match is not None:
                self.pool.release(p.match)
                p.match = None
        p.allocated = []  # the index (or the engine, for a partial page) owns them now
        return lock, cached + p.addrs[whole * bpp :]

    def _discard(self, session: Session, p: _Pending) -> None:
        """Undo a transfer that will not complete: revoke, free, unlock."""
        self.grants.revoke(session.peer_id, "write", p.granted)
        p.granted = []
        if p.allocated:
            self.pool.free_mem(p.allocated)
            p.allocated = []
        if p.match is not None:
            self.pool.release(p.match)
            p.match = None

    # ----------------------------------------------------------------- pull serving

    def _lock(self, session: Session, msg: m.Lock) -> m.Locked:
        if msg.lock_id in session.locks:
            raise InvalidRequest(f"lock {msg.lock_id} is already held")
        tokens = array("I")
        tokens.frombytes(msg.tokens)
        if not tokens:
            raise InvalidRequest("tokens must not be empty")
        found = self.pool.match(tokens, lock=True)
        if not found.num_tokens:
            self.pool.release(found)
            return m.Locked(msg.rid, [], 0)
        granted = [(int(t), off) for t, off in map(self.pool.offset_of, found.addrs)]
        self.grants.grant(session.peer_id, "read", granted)
        session.locks[msg.lock_id] = _Held(found, granted, self.clock())
        self.pulls_served += 1
        self.pull_tokens_locked += found.num_tokens
        return m.Locked(msg.rid, found.addrs, found.num_tokens)

    def _unlock(self, session: Session, held: _Held) -> None:
        self.grants.revoke(session.peer_id, "read", held.granted)
        self.pool.release(held.match)

    # ----------------------------------------------------------------- sessions

    def open(self, peer_id: int, close: Callable[[], None]) -> Session:
        session = Session(peer_id, close)
        self.sessions.add(session)
        return session

    def end(self, session: Session, why: str) -> None:
        """Free everything the session still holds."""
        if session not in self.sessions:
            return
        self.sessions.discard(session)
        blocks = sum(len(p.allocated) for p in session.transfers.values())
        if session.transfers or session.locks:
            log.warning(
                "instance %d: %s; freeing %d blocks of %d unfinished transfers, %d locks",
                session.peer_id,
                why,
                blocks,
                len(session.transfers),
                len(session.locks),
            )
        for pending in session.transfers.values():
            self._discard(session, pending)
        for held in session.locks.values():
            self._unlock(session, held)
        session.transfers.clear()
        session.locks.clear()
        session.close()

    def drop_peer(self, peer_id: int, why: str) -> None:
        for session in [s for s in self.sessions if s.peer_id == peer_id]:
            self.end(session, why)

    def sweep(self) -> int:
        """Free transfers and locks a live peer has held past the deadline (a sender that
        never commits, a reader that never unlocks); how many were dropped."""
        cutoff = self.clock() - self.pending_timeout_s
        dropped = 0
        for session in list(self.sessions):
            before = dropped
            for xfer, pending in list(session.transfers.items()):
                if pending.since < cutoff:
                    del session.transfers[xfer]
                    self._discard(session, pending)
                    dropped += 1
            for lock_id, held in list(session.locks.items()):
                if held.since < cutoff:
                    del session.locks[lock_id]
                    self._unlock(session, held)
                    dropped += 1
            if dropped > before:
                log.warning(
                    "instance %d held %d allocations or locks here for more than %ss; freed",
                    session.peer_id,
                    dropped - before,
                    self.pending_timeout_s,
                )
        return dropped

    # ----------------------------------------------------------------- arrivals

    def _arrived(self, received: Received) -> None:
        for i, (predicate, fut) in enumerate(self._waiters):
            if not fut.done() and predicate(received):
                fut.set_result(received)
                del self._waiters[i]
                break
        else:
            self._arrivals.append(received)
        if self.on_received is not None:
            try:
                result = self.on_received(received)
            except Exception:
                log.exception("on_received failed")
                return
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def wait(
        self, predicate: Callable[[Received], bool] | None, timeout: float | None
    ) -> Received:
        predicate = predicate or (lambda _r: True)
        for received in self._arrivals:
            if predicate(received):
                self._arrivals.remove(received)
                return received
        fut: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        entry = (predicate, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
