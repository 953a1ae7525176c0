"""TransferAgent: MemPool's distributed API (MemServe Table 1 and figure 2) for one instance.

`transfer` / `transfer_with_insert` push KV to a peer in three steps: allocation (the receiver
matches the tokens in its index and allocates only the pages it lacks, or checks the
`dst_addrs` given), transmission (the sender plans exact byte segments between the two
layouts, merges contiguous runs and writes them through the data transport), insertion and
acknowledgement. `pull` is KVDirect's reverse: lock a peer's cached prefix, read it into local
blocks, insert, unlock. `open_stream` sends a request layer by layer as the engine produces
it. The serving side of all of this runs in the same agent (`receiver.Receiver`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from mempool.address import MemType, instance_of
from mempool.errors import InvalidAddress, InvalidRequest
from mempool.pool import InsertFlags, MemPool, PrefixMatch
from mempool.radix import InsertResult, token_array
from mempool.transfer import messages as m
from mempool.transfer.base import (
    DataTransport,
    OfferExchanging,
    PeerInfo,
    Region,
    TransferFailed,
)
from mempool.transfer.control import ControlLink, accept_link, open_link
from mempool.transfer.grants import Grants
from mempool.transfer.local import LocalTransport
from mempool.transfer.membership import ClusterManager, InProcessCluster
from mempool.transfer.plan import KVGeometry, block_locations, check_compatible, plan_segments
from mempool.transfer.receiver import (
    OnReceived,
    Received,
    Receiver,
    TransferFlags,
    destination_tier,
)
from mempool.transfer.tcp import TcpTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """`dst_addrs`: the receiver's blocks for every page, cached prefix first.

    Pages are the receiver's pages; `calls` counts data-plane operations (after merging).
    """

    dst_addrs: list[int]
    pages_sent: int
    pages_skipped: int
    bytes: int
    calls: int
    seconds: float


@dataclass(slots=True)
class PullResult:
    """`addrs`: local blocks of the prefix now cached here (`num_tokens` tokens)."""

    addrs: list[int]
    num_tokens: int
    pages_pulled: int
    pages_skipped: int
    bytes: int
    calls: int
    seconds: float
    lock: InsertResult | PrefixMatch | None = None


class TransferStream:
    """One request's push, allocated once and sent layer by layer (MemServe figure 5, by-layer).

    `send_layers(a, b)` writes layers [a, b) of every page still missing at the receiver;
    `finish()` commits (insert when asked, acknowledgement); leaving the `async with` block
    on an exception aborts, and the receiver frees what it allocated.
    """

    def __init__(
        self,
        agent: TransferAgent,
        link: ControlLink,
        xfer: int,
        src_locs: list[tuple[int, int]],
        prepared: m.Prepared,
        num_tokens: int,
        flags: int,
    ) -> None:
        self._agent, self._link, self._xfer = agent, link, xfer
        self._src_locs = src_locs
        self.dst_addrs = prepared.addrs
        self.cached_pages = prepared.cached_pages
        self.num_tokens = num_tokens
        self.flags = flags
        dst = link.geometry
        self.pages_total = dst.pages_for(num_tokens)
        self._dst_locs = block_locations(
            prepared.addrs[prepared.cached_pages * dst.blocks_per_page :], dst.block_size
        )
        self.bytes = 0
        self.calls = 0
        self.done = False
        self._started = time.perf_counter()

    @property
    def peer_id(self) -> int:
        return self._link.peer.instance_id

    async def send_layers(self, start: int = 0, stop: int | None = None) -> int:
        """Write layers [start, stop) of the missing pages; the bytes written."""
        if self.done:
            raise InvalidRequest("the stream is finished or aborted")
        agent, dst = self._agent, self._link.geometry
        stop = agent.geometry.layers if stop is None else stop
        t0 = self.cached_pages * dst.page_size
        if t0 >= self.num_tokens:
            return 0
        # whole blocks, as engines move them: a partial last page goes as one run, not as
        # its valid rows one by one (the rest of its block is never read)
        src = agent.geometry
        t1 = min(src.pages_for(self.num_tokens) * src.page_size, self.pages_total * dst.page_size)
        segments = plan_segments(
            src,
            self._src_locs,
            0,
            dst,
            self._dst_locs,
            t0,
            (t0, t1),
            range(start, stop),
            merge=not self.flags & TransferFlags.NO_MERGE,
        )
        try:
            moved = await agent.transport.write(self._link.peer, segments)
        except BaseException:
            await self.abort()
            raise
        self.bytes += moved
        self.calls += len(segments)
        return moved

    async def finish(self) -> TransferResult:
        if self.done:
            raise InvalidRequest("the stream is finished or aborted")
        try:
            committed = await self._link.request(lambda rid: m.Commit(rid, self._xfer), m.Committed)
        except BaseException:
            await self.abort()
            raise
        self.done = True
        return TransferResult(
            committed.addrs,
            self.pages_total - self.cached_pages,
            self.cached_pages,
            self.bytes,
            self.calls,
            time.perf_counter() - self._started,
        )

    async def abort(self) -> None:
        """Tell the receiver to free this transfer's blocks, without waiting: a peer that is
        gone frees them when its side of the connection drops, or after pending_timeout_s."""
        if self.done:
            return
        self.done = True
        self._link.send(lambda rid: m.Abort(rid, self._xfer))

    async def __aenter__(self) -> TransferStream:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.done:
            if exc_type is None:
                await self.finish()
            else:
                await self.abort()


class TransferAgent:
    """An instance's transfer endpoint: client API, control server and data transport.

    `transport`: "tcp", "local" (pools of one process, memcpy) or a started-or-not
    DataTransport (RDMA, Mooncake). `membership`: where peers are looked up and whose dead-peer
    notices free their allocations; default, a private in-process table fed by `add_peer`.
    `secret`: shared HMAC secret for control and TCP data connections. `timeout_s`: the
    longest wait for any reply or any data progress. `head_start`/`total_heads`: this
    instance's tensor-parallel share of the KV heads. `on_received`: called (or awaited) with
    every `Received`. `pending_timeout_s`: how long a peer may hold blocks allocated or locked
    here for one transfer or pull before they are freed anyway. `allocate(count, tier)`: how
    blocks for incoming KV are found (default: the pool's free list; an engine passes one
    that evicts its cache). A transport with an
    `exchange` hook (RDMA) trades its connection offers over the control connection.
    """

    def __init__(
        self,
        pool: MemPool,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: str | DataTransport = "tcp",
        membership: ClusterManager | None = None,
        secret: bytes | str | None = None,
        timeout_s: float = 5.0,
        streams: int = 4,
        head_start: int = 0,
        total_heads: int = 0,
        on_received: OnReceived | None = None,
        pending_timeout_s: float = 60.0,
        allocate: Callable[[int, MemType], list[int]] | None = None,
    ) -> None:
        self.pool = pool
        self.instance_id = pool.instance_id
        self.host, self.port = host, port
        self.secret = secret
        self.timeout_s = timeout_s
        self.geometry = KVGeometry.of(pool.spec, pool.layout, head_start, total_heads)
        self.grants = Grants(pool.block_size)
        if isinstance(transport, DataTransport):
            self.transport = transport
        elif transport == "tcp":
            self.transport = TcpTransport(pool, host, 0, streams, secret, timeout_s)
        elif transport == "local":
            self.transport = LocalTransport(pool)
        else:
            raise InvalidRequest(f"unknown transport {transport!r}; expected tcp, local or one")
        if hasattr(self.transport, "access"):
            self.transport.access = self.grants.check
        if isinstance(self.transport, OfferExchanging) and self.transport.exchange is None:
            self.transport.exchange = self._exchange  # RDMA trades queue pairs here
        self._own_membership = membership is None
        self.membership = membership or InProcessCluster(ttl_s=float("inf"), heartbeat_s=3600)
        self.receiver = Receiver(
            pool, self.geometry, self.grants, on_received, pending_timeout_s, allocate=allocate
        )
        self.info: PeerInfo | None = None
        self._server: asyncio.base_events.Server | None = None
        self._links: dict[int, ControlLink] = {}
        self._link_locks: dict[int, asyncio.Lock] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._next_id = 0

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> PeerInfo:
        endpoint = await self.transport.start()
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        regions = tuple(
            Region(int(t), self.pool.region_base(t), a.nbytes) for t, a in self.pool.arenas.items()
        )
        self.info = PeerInfo(
            self.instance_id, self.host, self.port, regions, {self.transport.name: endpoint}
        )
        self.membership.on_dead(self._on_dead)
        try:
            await self.membership.join(self.info)
        except BaseException:
            await self.close()
            raise
        self._sweeper = asyncio.create_task(self._sweep())
        return self.info

    async def close(self) -> None:
        self.membership.remove_callback(self._on_dead)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._own_membership:
            await self.membership.close()
        elif self.info is not None:
            await self.membership.leave(self.instance_id)
        for link in list(self._links.values()):
            link.close("the agent closed")
            await link.wait_closed()
        self._links.clear()
        if self._server is not None:
            self._server.close()
        for session in list(self.receiver.sessions):
            self.receiver.end(session, "the agent closed")
        if self._serving:
            await asyncio.gather(*self._serving, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await self.transport.close()

    async def __aenter__(self) -> TransferAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def add_peer(self, info: PeerInfo) -> None:
        """Make a peer known without a shared membership service (static configuration)."""
        await self.membership.register(info)

    # ----------------------------------------------------------------- push

    async def transfer(
        self,
        id: int,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int] | None = None,
        flags: TransferFlags | int = TransferFlags.NONE,
        private: Any = None,
        *,
        layers: range | None = None,
        num_tokens: int | None = None,
    ) -> TransferResult:
        """Send blocks to instance `id`; it allocates unless `dst_addrs` are given.

        `layers` sends only those layers (by-layer mode: later calls pass the returned
        dst_addrs). `num_tokens` says how many tokens the blocks hold when the last page is
        partial (default: every page full).
        """
        stream = await self.open_stream(
            id, src_addrs, dst_addrs=dst_addrs, flags=flags, private=private, num_tokens=num_tokens
        )
        async with stream:
            if layers is None:
                await stream.send_layers()
            else:
                await stream.send_layers(layers.start, layers.stop)
            return await stream.finish()

    async def transfer_with_insert(
        self,
        id: int,
        tokens: Sequence[int] | array[int],
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int] | None = None,
        flags: TransferFlags | int = TransferFlags.NONE,
        private: Any = None,
    ) -> TransferResult:
        """Send a prompt's KV; the receiver inserts its whole pages into its index.

        Incremental: the receiver first matches `tokens` and the sender sends only the pages
        it lacks. `src_addrs` holds the blocks of every page of `tokens` (partial last page
        included: it is sent, not indexed).
        """
        stream = await self.open_stream(
            id, src_addrs, tokens=tokens, dst_addrs=dst_addrs, flags=flags, private=private
        )
        async with stream:
            await stream.send_layers()
            return await stream.finish()

    async def open_stream(
        self,
        id: int,
        src_addrs: Sequence[int],
        *,
        tokens: Sequence[int] | array[int] | None = None,
        dst_addrs: Sequence[int] | None = None,
        flags: TransferFlags | int = TransferFlags.NONE,
        private: Any = None,
        num_tokens: int | None = None,
    ) -> TransferStream:
        """Allocation step of a push; the returned stream sends and commits it."""
        geo = self.geometry
        toks = token_array(tokens) if tokens is not None else None
        src, src_locs = self._check_src(src_addrs)
        pages = len(src) // geo.blocks_per_page
        if toks is not None:
            if num_tokens is not None and num_tokens != len(toks):
                raise InvalidRequest(f"num_tokens={num_tokens} but {len(toks)} tokens given")
            num_tokens = len(toks)
        elif num_tokens is None:
            num_tokens = pages * geo.page_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidRequest(f"num_tokens must be a positive int, got {num_tokens!r}")
        if geo.pages_for(num_tokens) != pages:
            raise InvalidRequest(
                f"{num_tokens} tokens fill {geo.pages_for(num_tokens)} pages of "
                f"{geo.page_size} here ({geo.pages_for(num_tokens) * geo.blocks_per_page} "
                f"blocks), but {len(src)} source blocks ({pages} pages) were given"
            )
        try:
            msgspec.msgpack.encode(private)
        except (TypeError, msgspec.EncodeError) as exc:
            raise InvalidRequest(f"private must be msgpack-serializable: {exc}") from None
        dst = None
        if dst_addrs is not None:
            dst = self._check_dst(id, dst_addrs)
        link = await self._link(id)
        check_compatible(geo, link.geometry, cover_dst=dst is None)
        if dst is not None:
            need = link.geometry.pages_for(num_tokens) * link.geometry.blocks_per_page
            if len(dst) != need:
                raise InvalidRequest(
                    f"the receiver needs {need} destination addresses for {num_tokens} tokens "
                    f"({link.geometry.layout} layout, pages of {link.geometry.page_size}), "
                    f"got {len(dst)}"
                )
        xfer = link.new_id()
        prepared = await link.request(
            lambda rid: m.Prepare(
                rid,
                xfer,
                num_tokens,
                toks.tobytes() if toks is not None else None,
                dst,
                int(flags),
                private,
                toks is not None,
            ),
            m.Prepared,
        )
        return TransferStream(self, link, xfer, src_locs, prepared, num_tokens, int(flags))

    def _check_src(self, src_addrs: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """The source blocks and where their bytes are; InvalidAddress unless all are ours."""
        if isinstance(src_addrs, int | str | bytes):
            raise InvalidRequest(f"src_addrs must be a list of addresses, not {src_addrs!r}")
        src = list(src_addrs)
        bpp = self.geometry.blocks_per_page
        if not src or len(src) % bpp:
            raise InvalidRequest(
                f"{len(src)} source blocks is not a whole number of pages ({bpp} blocks per "
                f"page in the {self.geometry.layout} layout)"
            )
        locs = [(int(t), off) for t, off in map(self.pool.offset_of, src)]
        return src, locs

    def _check_dst(self, id: int, dst_addrs: Sequence[int]) -> list[int]:
        if isinstance(dst_addrs, int | str | bytes):
            raise InvalidRequest(f"dst_addrs must be a list of addresses, not {dst_addrs!r}")
        dst = list(dst_addrs)
        for addr in dst:
            if not isinstance(addr, int) or instance_of(addr) != id:
                owner = instance_of(addr) if isinstance(addr, int) else "nobody"
                raise InvalidAddress(
                    f"destination address {addr!r} belongs to instance {owner}, not to the "
                    f"receiver {id}"
                )
        return dst

    # ----------------------------------------------------------------- pull

    async def pull(
        self,
        id: int,
        tokens: Sequence[int] | array[int],
        flags: TransferFlags | int = TransferFlags.NONE,
        *,
        before_read: Callable[[int], Awaitable[None]] | None = None,
    ) -> PullResult:
        """Read the part of `tokens`' cached prefix that instance `id` has and we lack.

        The peer locks its prefix while we read it (KVDirect pull mode), we insert it into
        the local index, then the peer unlocks. With LOCK the local prefix stays locked
        (`result.lock`) for the request about to run. `before_read(pages)` is awaited once
        the local blocks are allocated, before the data moves (an engine models the wire
        time of stand-in bytes there, as a push does between allocation and data).

        Safe to cancel (a caller's deadline): what was allocated or locked here is freed at
        once, and a lock asked of the peer is released without waiting for its answer.
        """
        started = time.perf_counter()
        toks = token_array(tokens)
        geo = self.geometry
        link = await self._link(id)
        check_compatible(link.geometry, geo, cover_dst=True)
        local = self.pool.match(toks, lock=True)
        keep_local = False
        lock_id = link.new_id()
        remote: m.Locked | None = None
        fresh: list[int] = []
        done = False
        try:
            remote = await link.request(lambda rid: m.Lock(rid, lock_id, toks.tobytes()), m.Locked)
            have = local.num_tokens
            target = remote.num_tokens // geo.page_size * geo.page_size
            skipped = have // geo.page_size
            if target <= have:  # nothing longer there: the local prefix is the answer
                keep_local = bool(flags & TransferFlags.LOCK)
                done = True
                return PullResult(
                    local.addrs,
                    have,
                    0,
                    skipped,
                    0,
                    0,
                    time.perf_counter() - started,
                    local if keep_local else None,
                )
            pages = (target - have) // geo.page_size
            fresh = sorted(self.receiver.allocate(pages * geo.blocks_per_page, self._tier(flags)))
            if before_read is not None:
                await before_read(pages)
            segments = plan_segments(
                link.geometry,
                block_locations(remote.addrs, link.geometry.block_size),
                0,
                geo,
                [(int(t), off) for t, off in map(self.pool.offset_of, fresh)],
                have,
                (have, target),
                merge=not flags & TransferFlags.NO_MERGE,
            )
            moved = await self.transport.read(link.peer, segments)
            insert_flags = InsertFlags.LOCK if flags & TransferFlags.LOCK else InsertFlags.NONE
            inserted = self.pool.insert(toks[:target], local.addrs + fresh, insert_flags)
            fresh = []  # the index owns them now
            done = True
            return PullResult(
                self.pool.match(toks[:target]).addrs,
                target,
                pages,
                skipped,
                moved,
                len(segments),
                time.perf_counter() - started,
                inserted if flags & TransferFlags.LOCK else None,
            )
        finally:
            if fresh:
                self.pool.free_mem(fresh)
            if not keep_local:
                self.pool.release(local)
            if done and remote is not None and remote.num_tokens:
                await self._unlock(link, lock_id)
            elif not done and (remote is None or remote.num_tokens):
                # Failed or cancelled, perhaps before the peer's answer to the lock came: an
                # unlock sent behind the lock on the same connection releases it either way
                # (refused as unknown when nothing was locked), and nothing waits on a peer
                # that may be the reason this pull failed.
                link.send(lambda rid: m.Unlock(rid, lock_id))

    async def _unlock(self, link: ControlLink, lock_id: int) -> None:
        if link.closed:
            return
        try:
            await link.request(lambda rid: m.Unlock(rid, lock_id), m.Done)
        except Exception as exc:  # the peer frees its locks when our session ends anyway
            log.info("unlock %d at %s failed: %s", lock_id, link.where, exc)

    def _tier(self, flags: int) -> MemType:
        return destination_tier(self.pool, flags)

    # ----------------------------------------------------------------- receiving

    async def wait_received(
        self, predicate: Callable[[Received], bool] | None = None, timeout: float | None = None
    ) -> Received:
        """The next arrival matching `predicate` (one already arrived counts); TimeoutError."""
        return await self.receiver.wait(predicate, timeout)

    # ----------------------------------------------------------------- peers

    async def _link(self, id: int) -> ControlLink:
        if isinstance(id, bool) or not isinstance(id, int):
            raise InvalidRequest(f"instance id must be an int, got {id!r}")
        if id == self.instance_id:
            raise InvalidRequest(f"instance {id} is this instance; use the pool directly")
        if self.info is None:
            raise InvalidRequest("the agent is not started")
        link = self._links.get(id)
        if link is not None and not link.closed:
            return link
        lock = self._link_locks.setdefault(id, asyncio.Lock())
        async with lock:
            link = self._links.get(id)
            if link is not None and not link.closed:
                return link
            info = await self.membership.lookup(id)
            me = m.Hello(self.info, self.geometry)
            link = await open_link(info, me, self.secret, self.timeout_s)
            if self.transport.name not in link.peer.endpoints:
                link.close("no common transport")
                offered = ", ".join(link.peer.endpoints) or "none"
                raise TransferFailed(
                    f"instance {id} offers no {self.transport.name!r} data endpoint "
                    f"(it offers {offered})"
                )
            self._links[id] = link  # the transport's connect may trade offers over it
            try:
                await self.transport.connect(link.peer)
            except BaseException:
                self._links.pop(id, None)
                link.close("data connection failed")
                raise
            return link

    async def _exchange(self, peer: PeerInfo, offer: dict[str, Any]) -> dict[str, Any]:
        """The transport's offer to the peer's transport, over the control connection."""
        link = self._links.get(peer.instance_id)
        if link is None or link.closed:
            raise TransferFailed(f"no control connection to instance {peer.instance_id}")
        name = self.transport.name
        reply = await link.request(lambda rid: m.Exchange(rid, name, offer), m.Exchanged)
        return reply.answer

    async def _accept(self, peer_id: int, msg: m.Exchange) -> m.Reply:
        accept = getattr(self.transport, "accept", None)
        if msg.transport != self.transport.name or accept is None:
            why = f"this instance runs the {self.transport.name} transport, not {msg.transport}"
            return m.Refused(msg.rid, "TransferFailed", why)
        if msg.offer.get("instance_id", peer_id) != peer_id:
            return m.Refused(msg.rid, "TransferFailed", "an offer made for another instance")
        try:
            return m.Exchanged(msg.rid, await accept(msg.offer))
        except Exception as exc:
            return m.Refused(msg.rid, "TransferFailed", f"{self.transport.name}: {exc}")

    async def _on_dead(self, peer_id: int) -> None:
        """MemServe 4.4: fail what is in flight to it, free what it holds here."""
        if peer_id == self.instance_id:
            return
        link = self._links.pop(peer_id, None)
        if link is not None:
            link.close(f"instance {peer_id} left the cluster (no heartbeat)")
        await self.transport.disconnect(peer_id)
        self.receiver.drop_peer(peer_id, "it left the cluster (no heartbeat)")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self.info is not None
        self._serving.add(task)
        try:
            try:
                hello = await accept_link(
                    reader, writer, m.Hello(self.info, self.geometry), self.secret, self.timeout_s
                )
            except (TransferFailed, OSError, ConnectionError, TimeoutError, ValueError) as exc:
                log.warning(
                    "control connection refused during authentication: %s",
                    str(exc) or type(exc).__name__,
                )
                writer.close()
                return
            session = self.receiver.open(hello.info.instance_id, writer.close)
            why = "the control connection closed"
            try:
                while True:
                    msg = await m.read_message(reader)
                    if isinstance(msg, m.Exchange):
                        reply = await self._accept(session.peer_id, msg)
                    else:
                        reply = self.receiver.handle(session, msg)
                    writer.write(m.encode(reply))
                    await writer.drain()
            except asyncio.IncompleteReadError:
                pass
            except (ConnectionError, OSError, ValueError) as exc:
                why = f"the control connection failed ({exc})"
            finally:
                self.receiver.end(session, why)
        finally:
            self._serving.discard(task)
            writer.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.receiver.pending_timeout_s / 4))
            self.receiver.sweep()

    def session_count(self) -> int:
        return len(self.receiver.sessions)
