"""Control connections: authenticated asyncio streams carrying request/reply messages.

The client side (`ControlLink`) multiplexes concurrent requests over one connection per peer,
matching replies by request id. Every request has a deadline: a peer that stops answering
fails the request with TransferFailed naming it, and the link is closed so every other request
in flight to that peer fails too (never a hang). A refusal from the peer is re-raised as the
MemPool exception it was (OutOfBlocks, InvalidAddress, ...), prefixed with the peer's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

from mempool import errors
from mempool.transfer import messages as m
from mempool.transfer.auth import (
    AuthenticationFailed,
    Recv,
    Send,
    client_handshake,
    server_handshake,
)
from mempool.transfer.base import PeerInfo, TransferFailed
from mempool.transfer.plan import KVGeometry

log = logging.getLogger(__name__)

_REFUSALS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        errors.MemPoolError,
        errors.OutOfBlocks,
        errors.InvalidAddress,
        errors.BlockInUse,
        errors.InvalidRequest,
        errors.InvalidTokens,
    )
}

R = TypeVar("R", bound=m.Reply)


def stream_io(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Send, Recv]:
    """(send, recv) callables over an asyncio stream, for the handshake."""

    async def send(data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    async def recv(n: int) -> bytes:
        try:
            return await reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise ConnectionError("the peer closed the connection") from None

    return send, recv


def refusal(rid: int, exc: Exception) -> m.Refused:
    kind = type(exc).__name__ if type(exc).__name__ in _REFUSALS else "TransferFailed"
    return m.Refused(rid, kind, str(exc))


class ControlLink:
    """One authenticated control connection to a peer, shared by all transfers to it."""

    def __init__(
        self,
        peer: PeerInfo,
        geometry: KVGeometry,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timeout_s: float,
    ) -> None:
        self.peer = peer
        self.geometry = geometry
        self.timeout_s = timeout_s
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future[m.Message]] = {}
        self._next = 0
        self.closed: str | None = None  # why, once closed
        self._task = asyncio.get_running_loop().create_task(self._read_replies())

    @property
    def where(self) -> str:
        return f"instance {self.peer.instance_id} at {self.peer.host}:{self.peer.port}"

    def new_id(self) -> int:
        self._next += 1
        return self._next

    async def request(self, make: Callable[[int], m.Request], expect: type[R]) -> R:
        """Send a request and wait for its reply; raises on refusal, loss or timeout."""
        if self.closed:
            raise TransferFailed(f"{self.where}: {self.closed}")
        rid = self.new_id()
        msg = make(rid)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        what = type(msg).__name__.lower()
        try:
            self._writer.write(m.encode(msg))
            async with asyncio.timeout(self.timeout_s):
                await self._writer.drain()
                reply = await fut
        except TimeoutError:
            self.close(f"no reply to {what} within {self.timeout_s}s")
            why = f"no reply to {what} within {self.timeout_s}s"
            raise TransferFailed(f"{self.where}: {why}") from None
        except (ConnectionError, OSError) as exc:
            self.close(f"control connection lost ({exc})")
            raise TransferFailed(f"{self.where}: control connection lost ({exc})") from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, m.Refused):
            cls = _REFUSALS.get(reply.kind, TransferFailed)
            raise cls(f"instance {self.peer.instance_id} refused {what}: {reply.message}")
        if not isinstance(reply, expect):
            self.close(f"protocol error: {type(reply).__name__} in reply to {what}")
            raise TransferFailed(f"{self.where}: {type(reply).__name__} in reply to {what}")
        return reply

    def send(self, make: Callable[[int], m.Request]) -> None:
        """Fire and forget (an abort to a peer that may be gone: never wait on it)."""
        if not self.closed:
            self._writer.write(m.encode(make(self.new_id())))

    async def _read_replies(self) -> None:
        reason = "control connection closed by the peer"
        try:
            while True:
                msg = await m.read_message(self._reader)
                fut = self._pending.get(getattr(msg, "rid", -1))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError, ValueError) as exc:
            reason = f"control connection lost ({exc})"
        except asyncio.CancelledError:
            reason = self.closed or "closed"
        self.close(reason)

    def close(self, reason: str) -> None:
        """Fail every request in flight with `reason` and drop the connection."""
        if self.closed is None:
            self.closed = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(TransferFailed(f"{self.where}: {self.closed}"))
        self._pending.clear()
        self._writer.close()
        if not self._task.done() and self._task is not asyncio.current_task():
            self._task.cancel()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


async def open_link(
    info: PeerInfo,
    me: m.Hello,
    secret: bytes | str | None,
    timeout_s: float,
) -> ControlLink:
    """Connect, authenticate both ways and exchange Hellos; TransferFailed naming the peer."""
    where = f"instance {info.instance_id} at {info.host}:{info.port}"
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(info.host, info.port)
            send, recv = stream_io(reader, writer)
            sid = await client_handshake(send, recv, secret, "ctl", me.info.instance_id)
            if sid != info.instance_id:
                raise TransferFailed(f"{info.host}:{info.port} is instance {sid}, not {where}")
            await send(m.encode(me))
            hello = await m.read_message(reader)
    except AuthenticationFailed as exc:
        if writer is not None:
            writer.close()
        raise AuthenticationFailed(f"{where}: {exc}") from None
    except TransferFailed:
        if writer is not None:
            writer.close()
        raise
    except (OSError, ConnectionError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        if writer is not None:
            writer.close()
        raise TransferFailed(f"{where} unreachable: {str(e) or type(e).__name__}") from None
    except BaseException:  # cancelled (a caller's deadline): no half-open connection stays
        if writer is not None:
            writer.close()
        raise
    if not isinstance(hello, m.Hello):
        writer.close()
        raise TransferFailed(f"{where} answered {type(hello).__name__} instead of Hello")
    return ControlLink(hello.info, hello.geometry, reader, writer, timeout_s)


async def accept_link(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: m.Hello,
    secret: bytes | str | None,
    timeout_s: float,
) -> m.Hello:
    """Serving side of `open_link`: the authenticated client's Hello, or raises."""
    send, recv = stream_io(reader, writer)
    async with asyncio.timeout(timeout_s):
        cid = await server_handshake(send, recv, secret, "ctl", me.info.instance_id)
        hello = await m.read_message(reader)
        if not isinstance(hello, m.Hello) or hello.info.instance_id != cid:
            raise AuthenticationFailed(f"instance {cid} sent no Hello, or one for another id")
        await send(m.encode(me))
    return hello
