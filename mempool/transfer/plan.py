"""Exact byte mapping between two instances' KV blocks, whatever their layouts (MemServe 4.3).

Sender and receiver may differ in layout (discrete: one block per layer's K or V of a page;
aggregated: one block per page), in page size (16 vs 32 tokens per page) and in the
tensor-parallel share of KV heads each holds. Within a page both layouts order bytes as
layer-major, K before V, then token, head, dim (`mempool.layout`), so any token range of any
layer maps to runs of bytes that can be computed, not searched. Runs contiguous on both sides
are merged (KVDirect's transaction merging).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mempool.address import block_of, mem_type_of
from mempool.errors import InvalidRequest
from mempool.layout import DTYPE_BYTES, KVBlockSpec, Layout
from mempool.transfer.base import Segment, merge_segments

Location = tuple[int, int]  # (memory type value, byte offset of a block in its arena)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """How one instance stores KV: what a peer needs to address its blocks byte by byte.

    The instance holds heads [head_start, head_start + kv_heads) of `total_heads` (its
    tensor-parallel share); `page_size` tokens per page; `layout` 'discrete' or 'aggregated'.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    layout: str
    head_start: int = 0
    total_heads: int = 0  # 0: kv_heads (the instance holds every head)

    def __post_init__(self) -> None:
        spec = self.spec  # validates the shape fields
        Layout.parse(self.layout)
        total = self.total_heads or spec.kv_heads
        if self.head_start < 0 or self.head_start + self.kv_heads > total:
            raise InvalidRequest(
                f"heads [{self.head_start}, {self.head_start + self.kv_heads}) do not fit in "
                f"{total} total KV heads"
            )

    @classmethod
    def of(
        cls, spec: KVBlockSpec, layout: Layout | str, head_start: int = 0, total_heads: int = 0
    ) -> KVGeometry:
        return cls(
            spec.layers,
            spec.kv_heads,
            spec.head_dim,
            spec.dtype,
            spec.page_size,
            Layout.parse(layout).value,
            head_start,
            total_heads or spec.kv_heads,
        )

    @property
    def spec(self) -> KVBlockSpec:
        return KVBlockSpec(self.layers, self.kv_heads, self.head_dim, self.dtype, self.page_size)

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, self.head_start + self.kv_heads

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's heads in one layer's K (or V)."""
        return self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def segment_bytes(self) -> int:
        return self.page_size * self.row_bytes

    @property
    def aggregated(self) -> bool:
        return self.layout == Layout.AGGREGATED.value

    @property
    def block_size(self) -> int:
        return self.segment_bytes * (2 * self.layers if self.aggregated else 1)

    @property
    def blocks_per_page(self) -> int:
        return 1 if self.aggregated else 2 * self.layers

    def pages_for(self, num_tokens: int) -> int:
        """Pages (whole or partial) that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)


def block_locations(addrs: Sequence[int], block_size: int) -> list[Location]:
    """Where a peer's blocks live, from their addresses alone (an address names its tier)."""
    return [(mem_type_of(a), block_of(a) * block_size) for a in addrs]


def check_compatible(src: KVGeometry, dst: KVGeometry, *, cover_dst: bool) -> None:
    """Refuse geometries whose bytes cannot be mapped; `cover_dst`: src must hold every dst head.

    A receiver that allocates fresh blocks needs all of its heads filled by this one sender;
    with destination addresses given, a sender may fill only its share (tensor-parallel ranks
    writing into one receiver's blocks).
    """
    for name in ("layers", "head_dim", "dtype"):
        if getattr(src, name) != getattr(dst, name):
            raise InvalidRequest(
                f"KV shapes differ: sender {name}={getattr(src, name)!r}, "
                f"receiver {name}={getattr(dst, name)!r}"
            )
    src_total = src.total_heads or src.kv_heads
    dst_total = dst.total_heads or dst.kv_heads
    if src_total != dst_total:
        raise InvalidRequest(
            f"sender has {src_total} KV heads in all, receiver {dst_total}: not one model"
        )
    lo, hi = max(src.head_start, dst.head_start), min(src.heads[1], dst.heads[1])
    if lo >= hi:
        raise InvalidRequest(
            f"sender heads {src.heads} and receiver heads {dst.heads} are disjoint"
        )
    if cover_dst and (src.heads[0] > dst.heads[0] or src.heads[1] < dst.heads[1]):
        raise InvalidRequest(
            f"receiver holds heads {dst.heads} but the sender only {src.heads}; give dst_addrs "
            "to fill a receiver from several tensor-parallel senders"
        )


def _segment_offset(geo: KVGeometry, locs: Sequence[Location], page: int, seg: int) -> Location:
    """(tier, byte offset) of segment `seg` (2*layer + is_value) of local page `page`."""
    if geo.aggregated:
        mem_type, base = locs[page]
        return mem_type, base + seg * geo.segment_bytes
    return locs[page * 2 * geo.layers + seg]


def plan_segments(
    src: KVGeometry,
    src_locs: Sequence[Location],
    src_first_token: int,
    dst: KVGeometry,
    dst_locs: Sequence[Location],
    dst_first_token: int,
    tokens: tuple[int, int],
    layers: range | None = None,
    merge: bool = True,
) -> list[Segment]:
    """Segments copying tokens [t0, t1) of `layers` from src blocks to dst blocks.

    `src_locs` are the locations of blocks_per_page blocks per page for consecutive src pages,
    the first of which starts at token `src_first_token` (likewise for dst). Pieces are
    produced page pair by page pair, layer by layer, so that merging finds whole pages when
    both sides are contiguous; without `merge` pieces join only inside one block on each side
    (one call per block, as an engine without merging issues them).
    """
    t0, t1 = tokens
    if not 0 <= t0 <= t1:
        raise InvalidRequest(f"token range [{t0}, {t1}) is empty or negative")
    if t0 < src_first_token or t0 < dst_first_token:
        raise InvalidRequest("the token range starts before the blocks given")
    for geo, locs, first, side in (
        (src, src_locs, src_first_token, "source"),
        (dst, dst_locs, dst_first_token, "destination"),
    ):
        if first % geo.page_size:
            raise InvalidRequest(f"{side} blocks must start on a page boundary, not {first}")
        if len(locs) % geo.blocks_per_page:
            raise InvalidRequest(
                f"{len(locs)} {side} blocks is not a whole number of pages "
                f"({geo.blocks_per_page} blocks per page)"
            )
        have = len(locs) // geo.blocks_per_page * geo.page_size
        if t1 > first + have:
            raise InvalidRequest(f"{side} blocks hold tokens up to {first + have}, {t1} needed")
    layers = range(src.layers) if layers is None else layers
    if layers.step != 1 or layers.start < 0 or layers.stop > src.layers:
        raise InvalidRequest(f"layers {layers} outside 0..{src.layers} (step 1)")
    itemsize = DTYPE_BYTES[src.dtype]
    lo_head, hi_head = max(src.head_start, dst.head_start), min(src.heads[1], dst.heads[1])
    run = (hi_head - lo_head) * src.head_dim * itemsize
    whole_rows = src.heads == dst.heads
    src_head = (lo_head - src.head_start) * src.head_dim * itemsize
    dst_head = (lo_head - dst.head_start) * dst.head_dim * itemsize
    src_row, dst_row = src.row_bytes, dst.row_bytes
    out: list[Segment] = []
    t = t0
    while t < t1:
        sp, s_in = divmod(t - src_first_token, src.page_size)
        dp, d_in = divmod(t - dst_first_token, dst.page_size)
        end = min(t1, t + src.page_size - s_in, t + dst.page_size - d_in)
        count = end - t
        for layer in layers:
            for seg in (2 * layer, 2 * layer + 1):
                s_type, s_off = _segment_offset(src, src_locs, sp, seg)
                d_type, d_off = _segment_offset(dst, dst_locs, dp, seg)
                s_off += s_in * src_row
                d_off += d_in * dst_row
                if whole_rows:
                    out.append(Segment(s_type, s_off, d_type, d_off, count * src_row))
                    continue
                for i in range(count):
                    out.append(
                        Segment(
                            s_type,
                            s_off + i * src_row + src_head,
                            d_type,
                            d_off + i * dst_row + dst_head,
                            run,
                        )
                    )
        t = end
    return merge_segments(out, None if merge else (src.block_size, dst.block_size))
