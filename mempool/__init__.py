"""MemPool: the KV-cache memory pool inside every instance (MemServe section 4).

Memory API (alloc_mem/free_mem, swap_out/swap_in), index API (insert/match/delete/evict) over
a page radix tree, and the KV layouts (discrete and huge-page aggregated).
"""

from mempool.address import Address, MemType, decode, encode
from mempool.errors import (
    BlockInUse,
    InvalidAddress,
    InvalidRequest,
    InvalidTokens,
    MemPoolError,
    OutOfBlocks,
)
from mempool.layout import KVBlockSpec, Layout, aggregate, disaggregate, transfer_segments
from mempool.pool import InsertFlags, MemPool, PrefixMatch
from mempool.radix import InsertResult, Match, RadixTree, TreeNode

__all__ = [
    "Address",
    "BlockInUse",
    "InsertFlags",
    "InsertResult",
    "InvalidAddress",
    "InvalidRequest",
    "InvalidTokens",
    "KVBlockSpec",
    "Layout",
    "Match",
    "MemPool",
    "MemPoolError",
    "MemType",
    "OutOfBlocks",
    "PrefixMatch",
    "RadixTree",
    "TreeNode",
    "aggregate",
    "decode",
    "disaggregate",
    "encode",
    "transfer_segments",
]
