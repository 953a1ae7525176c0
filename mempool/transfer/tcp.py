"""TCP data plane: one-sided writes and reads of arena bytes over several parallel streams.

Each peer gets `streams` authenticated connections. A write (or read) is cut into contiguous
shares of about equal bytes, one per stream, so large segments are sliced across streams.
On a stream an operation is a header naming the remote (tier, offset, length) pieces, then the
payload: sent with `sendmsg` straight from arena memoryviews and received with `recvmsg_into`
straight into them (no intermediate bytes objects), then a status reply. The serving side
checks every piece against its arena bounds and an access check (the control plane's grants)
before a byte lands, and answers refusals after draining, so the stream stays usable.

The transport works on its own: `start()` returns the endpoint a peer passes in
`PeerInfo.endpoints["tcp"]`, and `write`/`read` move `Segment`s between two pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mempool.errors import InvalidRequest
from mempool.pool import MemPool
from mempool.transfer import sockio
from mempool.transfer.auth import AuthenticationFailed, client_handshake, server_handshake
from mempool.transfer.base import DataTransport, PeerInfo, Segment, TransferFailed
from mempool.transfer.grants import AccessCheck, allow_all

log = logging.getLogger(__name__)

OP_WRITE, OP_READ = 1, 2
_REQ = struct.Struct("<BIQI")  # op, sequence, payload bytes, pieces; then pieces x 3 uint64
_REP = struct.Struct("<BIH")  # status (0 ok), sequence, message length; then the message
MAX_PIECES = 1 << 20
_DRAIN = 1 << 20


def _pieces_bytes(triples: array[int]) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - the wire is little-endian
        triples = array("Q", triples)
        triples.byteswap()
    return triples.tobytes()


def _pieces_from(raw: bytes | bytearray) -> array[int]:
    triples = array("Q")
    triples.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover
        triples.byteswap()
    return triples


def partition(segments: Sequence[Segment], parts: int, min_bytes: int) -> list[list[Segment]]:
    """Cut segments into up to `parts` runs of about equal bytes (each at least `min_bytes`)."""
    total = sum(s.length for s in segments)
    if not total:
        return []
    k = max(1, min(parts, total // max(1, min_bytes)))
    share = -(-total // k)
    out: list[list[Segment]] = [[] for _ in range(k)]
    cur, room = 0, share
    for seg in segments:
        off = 0
        while off < seg.length:
            take = min(seg.length - off, room)
            out[cur].append(
                Segment(
                    seg.src_type, seg.src_offset + off, seg.dst_type, seg.dst_offset + off, take
                )
            )
            off += take
            room -= take
            if room == 0 and cur < k - 1:
                cur, room = cur + 1, share
    return [p for p in out if p]


@dataclass(eq=False)
class _Stream:
    sock: socket.socket | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(eq=False)
class _Link:
    peer: PeerInfo
    address: tuple[str, int]
    streams: list[_Stream]
    seq: int = 0


class TcpTransport(DataTransport):
    """Zero-copy TCP transport over `streams` parallel connections per peer."""

    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        pool: MemPool,
        host: str = "127.0.0.1",
        port: int = 0,
        streams: int = 4,
        secret: bytes | str | None = None,
        timeout_s: float = 5.0,
        min_stream_bytes: int = 256 << 10,
        access: AccessCheck = allow_all,
    ) -> None:
        super().__init__()
        if streams < 1:
            raise InvalidRequest(f"streams must be >= 1, got {streams}")
        self.pool = pool
        self.instance_id = pool.instance_id
        self.host, self.port = host, port
        self.streams = streams
        self.secret = secret
        self.timeout_s = timeout_s
        self.min_stream_bytes = min_stream_bytes
        self.access = access
        self.bytes_sent = 0  # payload bytes this side pushed (writes) or served (reads)
        self.bytes_received = 0
        self._regions: dict[int, memoryview] = {}
        self._links: dict[int, _Link] = {}
        self._link_locks: dict[int, asyncio.Lock] = {}
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._served: dict[socket.socket, int] = {}  # accepted connection -> peer id
        self._serve_tasks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> dict[str, Any]:
        if self._listener is not None:
            return self.endpoint
        for mem_type in self.pool.arenas:
            try:
                self._regions[int(mem_type)] = self.pool.region(mem_type)
            except InvalidRequest:
                log.warning("tcp: the %s tier is on a GPU; it is not reachable", mem_type.name)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept())
        return self.endpoint

    @property
    def endpoint(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        sockio.close(self._listener)
        self._listener = None
        for peer_id in list(self._links):
            await self.disconnect(peer_id)
        for sock in list(self._served):
            sockio.abort(sock)
        if self._serve_tasks:
            await asyncio.gather(*self._serve_tasks, return_exceptions=True)
        self._regions.clear()

    # ----------------------------------------------------------------- client side

    async def connect(self, peer: PeerInfo) -> None:
        await self._link(peer)

    async def disconnect(self, peer_id: int) -> None:
        """Drop every stream to and from the peer; operations in flight fail at once."""
        link = self._links.pop(peer_id, None)
        if link is not None:
            for stream in link.streams:
                if stream.lock.locked():
                    sockio.abort(stream.sock)  # its operation fails and closes the socket
                else:
                    sockio.close(stream.sock)
                    stream.sock = None
        for sock, pid in list(self._served.items()):
            if pid == peer_id:
                sockio.abort(sock)

    async def write(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._move(peer, segments, OP_WRITE)

    async def read(self, peer: PeerInfo, segments: Sequence[Segment]) -> int:
        return await self._move(peer, segments, OP_READ)

    async def _move(self, peer: PeerInfo, segments: Sequence[Segment], op: int) -> int:
        for seg in segments:
            self._local_view(seg, op)  # bounds, before anything goes out
        link = await self._link(peer)
        parts = partition(segments, len(link.streams), self.min_stream_bytes)
        self.calls += len(segments)
        results = await asyncio.gather(
            *(self._run(link, link.streams[i], op, part) for i, part in enumerate(parts)),
            return_exceptions=True,
        )
        moved = 0
        for res in results:
            if isinstance(res, BaseException):
                raise res
            moved += res
        if op == OP_WRITE:
            self.bytes_sent += moved
        else:
            self.bytes_received += moved
        return moved

    def _local_view(self, seg: Segment, op: int) -> memoryview:
        mem_type, offset = (
            (seg.src_type, seg.src_offset)
            if op == OP_WRITE
            else (
                seg.dst_type,
                seg.dst_offset,
            )
        )
        region = self._regions.get(mem_type)
        if region is None:
            raise InvalidRequest(f"tcp: no local tier {mem_type} (transport started?)")
        if seg.length <= 0 or offset < 0 or offset + seg.length > len(region):
            raise InvalidRequest(
                f"tcp: local bytes [{offset}, {offset + seg.length}) outside tier {mem_type} "
                f"of {len(region)} bytes"
            )
        return region[offset : offset + seg.length]

    def _where(self, link: _Link) -> str:
        return f"instance {link.peer.instance_id} at {link.address[0]}:{link.address[1]}"

    async def _link(self, peer: PeerInfo) -> _Link:
        endpoint = peer.endpoints.get(self.name)
        if not endpoint:
            raise TransferFailed(f"instance {peer.instance_id} publishes no tcp data endpoint")
        address = (str(endpoint["host"]), int(endpoint["port"]))
        lock = self._link_locks.setdefault(peer.instance_id, asyncio.Lock())
        async with lock:
            link = self._links.get(peer.instance_id)
            if link is not None and link.address == address:
                return link
            if link is not None:  # the peer came back elsewhere
                await self.disconnect(peer.instance_id)
            link = _Link(peer, address, [_Stream() for _ in range(self.streams)])
            try:
                await asyncio.gather(*(self._open(link, s) for s in link.streams))
            except BaseException:
                for s in link.streams:
                    sockio.close(s.sock)
                raise
            self._links[peer.instance_id] = link
            return link

    async def _open(self, link: _Link, stream: _Stream) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(self.timeout_s):
                await loop.sock_connect(sock, link.address)
                sid = await client_handshake(
                    lambda b: sockio.send_all(sock, [b]),
                    lambda n: sockio.recv_exact(sock, n),
                    self.secret,
                    "data",
                    self.instance_id,
                )
        except AuthenticationFailed as exc:
            sock.close()
            raise AuthenticationFailed(f"tcp: {self._where(link)}: {exc}") from None
        except (OSError, TimeoutError, ConnectionError) as exc:
            sock.close()
            raise TransferFailed(
                f"tcp: {self._where(link)} unreachable: {str(exc) or type(exc).__name__}"
            ) from None
        except BaseException:  # cancelled mid-connect: the socket is not the stream's yet
            sock.close()
            raise
        if sid != link.peer.instance_id:
            sock.close()
            raise TransferFailed(
                f"tcp: {link.address[0]}:{link.address[1]} is instance {sid}, "
                f"not {link.peer.instance_id}"
            )
        stream.sock = sock

    async def _run(self, link: _Link, stream: _Stream, op: int, part: list[Segment]) -> int:
        """One operation on one stream: header, payload, status."""
        loop = asyncio.get_running_loop()
        views = [self._local_view(s, op) for s in part]
        remote = array("Q")
        for s in part:
            if op == OP_WRITE:
                remote.extend((s.dst_type, s.dst_offset, s.length))
            else:
                remote.extend((s.src_type, s.src_offset, s.length))
        total = sum(s.length for s in part)
        async with stream.lock:
            if stream.sock is None or stream.sock.fileno() < 0:
                await self._open(link, stream)
            sock = stream.sock
            assert sock is not None
            link.seq = (link.seq + 1) & 0xFFFFFFFF
            header = _REQ.pack(op, link.seq, total, len(part)) + _pieces_bytes(remote)
            try:
                async with asyncio.timeout(self.timeout_s) as cm:

                    def progress() -> None:
                        cm.reschedule(loop.time() + self.timeout_s)

                    if op == OP_WRITE:
                        await sockio.send_all(sock, [header, *views], progress)
                    else:
                        await sockio.send_all(sock, [header], progress)
                    reply = await sockio.recv_exact(sock, _REP.size, progress)
                    status, _, size = _REP.unpack(reply)
                    message = await sockio.recv_exact(sock, size, progress)
                    if status:
                        why = message.decode(errors="replace")
                        raise TransferFailed(f"tcp: {self._where(link)} refused: {why}")
                    if op == OP_READ:
                        await sockio.recv_into_all(sock, views, progress)
            except TransferFailed:
                raise
            except TimeoutError:
                sockio.close(sock)
                stream.sock = None
                raise TransferFailed(
                    f"tcp: {self._where(link)}: no progress for {self.timeout_s}s"
                ) from None
            except (OSError, ConnectionError) as exc:
                sockio.close(sock)
                stream.sock = None
                raise TransferFailed(f"tcp: {self._where(link)}: connection lost ({exc})") from None
            except BaseException:
                sockio.close(sock)  # cancelled mid-operation: the stream's state is unknown
                stream.sock = None
                raise
            finally:
                views.clear()
        return total

    # ----------------------------------------------------------------- serving side

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                log.warning("tcp: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(sock))
            self._serve_tasks.add(task)
            task.add_done_callback(self._serve_tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                peer = await server_handshake(
                    lambda b: sockio.send_all(sock, [b]),
                    lambda n: sockio.recv_exact(sock, n),
                    self.secret,
                    "data",
                    self.instance_id,
                )
        except (AuthenticationFailed, OSError, TimeoutError, ConnectionError) as exc:
            log.warning(
                "tcp: data connection refused during authentication: %s",
                str(exc) or type(exc).__name__,
            )
            sockio.close(sock)
            return
        self._served[sock] = peer
        try:
            while True:
                if not await self._serve_one(sock, peer):
                    break
        except (OSError, ConnectionError, TimeoutError) as exc:
            log.info("tcp: data connection from instance %d ended: %s", peer, exc)
        finally:
            self._served.pop(sock, None)
            sockio.close(sock)

    async def _serve_one(self, sock: socket.socket, peer: int) -> bool:
        """Serve one operation; False when the connection should close."""
        try:
            head = await sockio.recv_exact(sock, _REQ.size)
        except ConnectionError:
            return False  # the client hung up between operations
        op, seq, total, count = _REQ.unpack(head)
        if op not in (OP_WRITE, OP_READ) or count > MAX_PIECES:
            log.warning("tcp: instance %d sent a malformed header; closing", peer)
            return False
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s) as cm:

            def progress() -> None:
                cm.reschedule(loop.time() + self.timeout_s)

            triples = _pieces_from(await sockio.recv_exact(sock, count * 24, progress))
            if sum(triples[2::3]) != total:
                log.warning("tcp: instance %d: piece lengths disagree with the total", peer)
                return False
            kind = "write" if op == OP_WRITE else "read"
            views: list[memoryview] = []
            refusal = None
            for i in range(0, len(triples), 3):
                mem_type, offset, length = triples[i], triples[i + 1], triples[i + 2]
                region = self._regions.get(mem_type)
                if region is None or length == 0 or offset + length > len(region):
                    refusal = f"bytes [{offset}, {offset + length}) outside tier {mem_type}"
                    break
                refusal = self.access(peer, kind, mem_type, offset, length)
                if refusal:
                    break
                views.append(region[offset : offset + length])
            try:
                if refusal:
                    if op == OP_WRITE:
                        await self._drain(sock, total, progress)
                    message = refusal.encode()[:4096]
                    await sockio.send_all(sock, [_REP.pack(1, seq, len(message)), message])
                    return True
                if op == OP_WRITE:
                    await sockio.recv_into_all(sock, views, progress)
                    self.bytes_received += total
                    await sockio.send_all(sock, [_REP.pack(0, seq, 0)])
                else:
                    await sockio.send_all(sock, [_REP.pack(0, seq, 0), *views], progress)
                    self.bytes_sent += total
            finally:
                views.clear()
        return True

    async def _drain(self, sock: socket.socket, total: int, progress: Any) -> None:
        scratch = memoryview(bytearray(min(total, _DRAIN) or 1))
        left = total
        while left:
            n = min(left, len(scratch))
            await sockio.recv_into_all(sock, [scratch[:n]], progress)
            left -= n
