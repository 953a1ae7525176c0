"""Scatter-gather socket I/O on the event loop without copying payload bytes.

`sendmsg` takes the arena's memoryviews as they are and `recvmsg_into` lands bytes straight in
them: one syscall moves many segments, and no intermediate bytes object is ever built (asyncio's
own transports copy whatever the kernel did not take at once into a bytearray).
`progress` is called after every syscall that moved bytes, so a caller can push back an
inactivity deadline instead of guessing how long a large transfer may take.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Sequence

try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (ValueError, OSError):  # pragma: no cover - every Linux has it
    IOV_MAX = 1024

Buffer = bytes | bytearray | memoryview


def _noop() -> None:
    pass


async def _ready(sock: socket.socket, writable: bool) -> None:
    """Wait until the socket can be written (or read) without blocking."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.fileno()
    if fd < 0:
        raise ConnectionError("socket closed")

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def _views(bufs: Sequence[Buffer]) -> list[memoryview]:
    out = []
    for b in bufs:
        v = b if isinstance(b, memoryview) else memoryview(b)
        if v.ndim != 1 or v.itemsize != 1:
            v = v.cast("B")
        if len(v):
            out.append(v)
    return out


def _advance(views: list[memoryview], i: int, off: int, n: int) -> tuple[int, int]:
    while n:
        rest = len(views[i]) - off
        if n < rest:
            return i, off + n
        n -= rest
        i, off = i + 1, 0
    return i, off


async def send_all(
    sock: socket.socket, bufs: Sequence[Buffer], progress: Callable[[], None] = _noop
) -> int:
    """Send every buffer, in order; returns the bytes sent."""
    views = _views(bufs)
    i = off = total = 0
    while i < len(views):
        batch = [views[i][off:] if off else views[i], *views[i + 1 : i + IOV_MAX]]
        try:
            n = sock.sendmsg(batch)
        except (BlockingIOError, InterruptedError):
            await _ready(sock, True)
            continue
        total += n
        progress()
        i, off = _advance(views, i, off, n)
    return total


async def recv_into_all(
    sock: socket.socket, bufs: Sequence[memoryview], progress: Callable[[], None] = _noop
) -> int:
    """Fill every buffer, in order, from the socket; ConnectionError at EOF."""
    views = _views(bufs)
    i = off = total = 0
    while i < len(views):
        batch = [views[i][off:] if off else views[i], *views[i + 1 : i + IOV_MAX]]
        try:
            n = sock.recvmsg_into(batch)[0]
        except (BlockingIOError, InterruptedError):
            await _ready(sock, False)
            continue
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        total += n
        progress()
        i, off = _advance(views, i, off, n)
    return total


async def recv_exact(
    sock: socket.socket, size: int, progress: Callable[[], None] = _noop
) -> bytearray:
    """`size` bytes (for headers; payload goes through recv_into_all)."""
    buf = bytearray(size)
    if size:
        await recv_into_all(sock, [memoryview(buf)], progress)
    return buf


def abort(sock: socket.socket | None) -> None:
    """Wake whoever waits on the socket (reads see EOF, writes fail) without closing its fd."""
    if sock is None or sock.fileno() < 0:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def close(sock: socket.socket | None) -> None:
    if sock is not None and sock.fileno() >= 0:
        abort(sock)
        sock.close()
