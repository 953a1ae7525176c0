"""Control-plane messages (MemServe figure 2's allocate / transmit / insert / ack, and KVDirect's
lock-read-unlock pull), framed as a 4-byte length and msgpack over the control connection.

Requests carry a request id (`rid`) the reply repeats, so one connection per peer carries any
number of concurrent transfers. Tokens travel as uint32 bytes, the index's own key form.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec

from mempool.transfer.base import PeerInfo
from mempool.transfer.plan import KVGeometry

MAX_FRAME = 64 << 20
_LEN = struct.Struct("!I")


class Hello(msgspec.Struct, tag=True, array_like=True):
    """Exchanged once per control connection after authentication, both directions."""

    info: PeerInfo
    geometry: KVGeometry


class Prepare(msgspec.Struct, tag=True, array_like=True):
    """Allocation step: the receiver matches `tokens` (when inserting) and allocates the rest,
    or checks and reserves `dst_addrs` when the sender names them."""

    rid: int
    xfer: int
    num_tokens: int
    tokens: bytes | None
    dst_addrs: list[int] | None
    flags: int
    private: Any
    insert: bool


class Prepared(msgspec.Struct, tag=True, array_like=True):
    """Destination blocks for every page (cached prefix first) and how many pages were cached."""

    rid: int
    addrs: list[int]
    cached_pages: int


class Commit(msgspec.Struct, tag=True, array_like=True):
    """Transmission done: insert if asked, hand the blocks to the engine, acknowledge."""

    rid: int
    xfer: int


class Committed(msgspec.Struct, tag=True, array_like=True):
    rid: int
    addrs: list[int]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """The sender gave up: free what was allocated for this transfer."""

    rid: int
    xfer: int


class Lock(msgspec.Struct, tag=True, array_like=True):
    """Pull, step 1: match and lock the longest cached prefix of `tokens` for a reader."""

    rid: int
    lock_id: int
    tokens: bytes


class Locked(msgspec.Struct, tag=True, array_like=True):
    rid: int
    addrs: list[int]
    num_tokens: int


class Unlock(msgspec.Struct, tag=True, array_like=True):
    rid: int
    lock_id: int


class Exchange(msgspec.Struct, tag=True, array_like=True):
    """A data transport's connection offer (RDMA: qpn, psn, gid...) for the peer's `accept`."""

    rid: int
    transport: str
    offer: dict[str, Any]


class Exchanged(msgspec.Struct, tag=True, array_like=True):
    rid: int
    answer: dict[str, Any]


class Done(msgspec.Struct, tag=True, array_like=True):
    rid: int


class Refused(msgspec.Struct, tag=True, array_like=True):
    """A request the peer could not honour; `kind` names the MemPool exception class."""

    rid: int
    kind: str
    message: str


Request = Prepare | Commit | Abort | Lock | Unlock | Exchange
Reply = Prepared | Committed | Locked | Exchanged | Done | Refused
Message = Hello | Request | Reply

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> Message:
    """The next message; IncompleteReadError at EOF, ValueError for a malformed frame."""
    (size,) = _LEN.unpack(await reader.readexactly(4))
    if size > MAX_FRAME:
        raise ValueError(f"control frame of {size} bytes exceeds {MAX_FRAME}")
    try:
        return _decoder.decode(await reader.readexactly(size))
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed control message: {exc}") from None
