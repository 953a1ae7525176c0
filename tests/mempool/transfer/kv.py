"""Reference reconstruction of KV bytes straight from the layout definition, for checksums.

Independent of `mempool.transfer.plan`: it walks layer, K/V, token and head and reads each
head's bytes where `mempool.layout` says they live (layer-major, K before V, then token, head,
dim; discrete pages keep each layer's K and V in its own block).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

from mempool import KVBlockSpec, Layout, MemPool
from mempool.layout import DTYPE_BYTES


def logical_kv(
    spec: KVBlockSpec,
    layout: Layout | str,
    read_block: Callable[[int], bytes],
    addrs: Sequence[int],
    tokens: range,
    heads: tuple[int, int],
    head_start: int = 0,
    layers: range | None = None,
    first_token: int = 0,
) -> bytes:
    """Bytes of `tokens` x global `heads` for `layers`, in (layer, kv, token, head) order.

    `addrs` are blocks_per_page blocks per page, the first page starting at `first_token`.
    """
    layout = Layout.parse(layout)
    item = DTYPE_BYTES[spec.dtype]
    head_bytes = spec.head_dim * item
    row = spec.kv_heads * head_bytes
    blocks: dict[int, bytes] = {}

    def block(i: int) -> bytes:
        if i not in blocks:
            blocks[i] = read_block(addrs[i])
        return blocks[i]

    out = bytearray()
    for layer in layers if layers is not None else range(spec.layers):
        for kv in (0, 1):
            seg = 2 * layer + kv
            for t in tokens:
                page, i = divmod(t - first_token, spec.page_size)
                if layout is Layout.AGGREGATED:
                    data, base = block(page), seg * spec.segment_bytes
                else:
                    data, base = block(page * 2 * spec.layers + seg), 0
                for h in range(*heads):
                    start = base + i * row + (h - head_start) * head_bytes
                    out += data[start : start + head_bytes]
    return bytes(out)


def digest(pool: MemPool, addrs: Sequence[int], tokens: range, heads: tuple[int, int], **kw) -> str:
    """sha256 of the logical KV held by `addrs` of `pool`."""
    data = logical_kv(pool.spec, pool.layout, pool.read_block, addrs, tokens, heads, **kw)
    return hashlib.sha256(data).hexdigest()


def fill(pool: MemPool, addrs: Sequence[int]) -> None:
    """Random bytes in every block, as a prefill would leave them."""
    for addr in addrs:
        pool.write_block(addr, os.urandom(pool.block_size))


def free_counts(pool: MemPool) -> dict[str, int]:
    return {name: tier["free"] for name, tier in pool.stats()["tiers"].items()}


def alloc(pool: MemPool, count: int, mem_type: str = "host") -> list[int]:
    """Blocks in ascending order (adjacent blocks are adjacent bytes), filled with noise."""
    addrs = sorted(pool.alloc_blocks(count, mem_type))
    fill(pool, addrs)
    return addrs
