"""Mutual HMAC challenge-response run on every control and TCP data connection before any byte
of KV or any request is accepted.

Both sides send a fresh nonce; each proves it knows the shared secret by returning an HMAC over
both nonces, both instance ids and the channel kind, with a label per direction (so a reply
cannot be reflected back). Without a secret the key is empty: peers without a secret still
talk to each other, while one with a secret refuses one without. The server proves itself
first, so a client never sends its proof to an impostor.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Awaitable, Callable

from mempool.transfer.base import TransferFailed

MAGIC = b"MPX1"
NONCE = 32
_MAC = hashlib.sha256().digest_size
_OK, _NO = b"OK", b"NO"
_HEAD = struct.Struct("!4s4sI")  # magic, channel kind, instance id

Bytes = bytes | bytearray
Send = Callable[[bytes], Awaitable[object]]  # what it returns (bytes sent, say) is ignored
Recv = Callable[[int], Awaitable[Bytes]]


class AuthenticationFailed(TransferFailed):
    """The peer refused our proof or could not prove the shared secret."""


def _key(secret: bytes | str | None) -> bytes:
    if secret is None:
        return b""
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(key: bytes, label: bytes, kind: bytes, cn: Bytes, sn: Bytes, cid: int, sid: int) -> bytes:
    msg = b"|".join((b"mempool-auth", label, kind, cn, sn, b"%d" % cid, b"%d" % sid))
    return hmac.new(key, msg, hashlib.sha256).digest()


def _kind(kind: str) -> bytes:
    raw = kind.encode()
    if len(raw) > 4:
        raise ValueError(f"channel kind {kind!r} longer than 4 bytes")
    return raw.ljust(4, b"\0")


async def client_handshake(
    send: Send, recv: Recv, secret: bytes | str | None, kind: str, my_id: int
) -> int:
    """Authenticate to a server; returns the server's instance id or raises."""
    key, k = _key(secret), _kind(kind)
    cn = os.urandom(NONCE)
    await send(_HEAD.pack(MAGIC, k, my_id) + cn)
    head = await recv(_HEAD.size + NONCE + _MAC)
    magic, skind, sid = _HEAD.unpack_from(head)
    sid = int(sid)
    if magic != MAGIC or skind != k:
        raise AuthenticationFailed(f"the peer does not speak this protocol ({magic!r}, {skind!r})")
    sn = head[_HEAD.size : _HEAD.size + NONCE]
    proof = head[_HEAD.size + NONCE :]
    if not hmac.compare_digest(proof, _mac(key, b"server", k, cn, sn, my_id, sid)):
        raise AuthenticationFailed(
            f"instance {sid} could not prove the shared secret (secrets differ)"
        )
    await send(_mac(key, b"client", k, cn, sn, my_id, sid))
    if await recv(2) != _OK:
        raise AuthenticationFailed(f"instance {sid} refused our proof (secrets differ)")
    return sid


async def server_handshake(
    send: Send, recv: Recv, secret: bytes | str | None, kind: str, my_id: int
) -> int:
    """Authenticate a client; returns the client's instance id or raises."""
    key, k = _key(secret), _kind(kind)
    head = await recv(_HEAD.size + NONCE)
    magic, ckind, cid = _HEAD.unpack_from(head)
    cid = int(cid)
    if magic != MAGIC or ckind != k:
        raise AuthenticationFailed(f"a client that does not speak this protocol ({magic!r})")
    cn = head[_HEAD.size :]
    sn = os.urandom(NONCE)
    await send(_HEAD.pack(MAGIC, k, my_id) + sn + _mac(key, b"server", k, cn, sn, cid, my_id))
    proof = await recv(_MAC)
    if not hmac.compare_digest(proof, _mac(key, b"client", k, cn, sn, cid, my_id)):
        await send(_NO)
        raise AuthenticationFailed(f"instance {cid} failed authentication (secrets differ)")
    await send(_OK)
    return cid
