"""SGLang page keys as MemPool pages.

SGLang names an L3 page by a SHA-256 hex digest chained over every earlier page of the
sequence (`sglang.srt.mem_cache.utils.get_hash_str`: tokens as uint32 little-endian, the prior
page's digest prepended). A key therefore names its whole prefix on its own, and a server asks
for keys that start mid-sequence (after what its own tree holds). So each key is one page of
its own in MemPool's index: the page's "tokens" are the key's 32 digest bytes as 8 uint32, and
the block behind it holds SGLang's page bytes exactly. MemPool's geometry for these blocks is
one layer, one head, uint8: it treats a page as opaque bytes, which is what SGLang's flat data
page is.
"""

from __future__ import annotations

import hashlib
from array import array

from mempool import KVBlockSpec

KEY_TOKENS = 8  # 32 digest bytes = 8 uint32 "tokens": one MemPool page per SGLang page


def key_tokens(key: str) -> array[int]:
    """The MemPool page of one SGLang key (its digest words; other strings are hashed)."""
    if not isinstance(key, str):
        raise TypeError(f"an SGLang page key is a str, got {type(key).__name__}")
    try:
        digest = bytes.fromhex(key) if len(key) == 64 else b""
    except ValueError:
        digest = b""
    if not digest:  # not a bare SHA-256 hex digest (e.g. a suffixed key): hash it
        digest = hashlib.sha256(key.encode()).digest()
    return array("I", digest)


def page_spec(page_bytes: int) -> KVBlockSpec:
    """MemPool's block shape for SGLang pages of `page_bytes` bytes (one block per page)."""
    unit = 2 * KEY_TOKENS  # K and V halves of KEY_TOKENS "tokens" of one uint8 head
    if page_bytes <= 0 or page_bytes % unit:
        raise ValueError(
            f"an SGLang page of {page_bytes} bytes cannot be a MemPool block: it must be a "
            f"positive multiple of {unit} bytes"
        )
    return KVBlockSpec(
        layers=1, kv_heads=1, head_dim=page_bytes // unit, dtype="uint8", page_size=KEY_TOKENS
    )
