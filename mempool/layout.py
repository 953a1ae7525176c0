"""KV block shapes and the two layouts of the same bytes: discrete and aggregated.

Paged engines keep one block per layer for K and one for V: 2*L blocks per page, so moving a
page costs 2*L network calls. MemServe aggregates them into one huge block per page (one call).
Both layouts order a page's bytes identically (layer-major, K before V), so conversion is a
pure regrouping of segments and round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

Buffer = bytes | bytearray | memoryview


class Layout(Enum):
    DISCRETE = "discrete"
    AGGREGATED = "aggregated"

    @classmethod
    def parse(cls, value: object) -> Layout:
        if isinstance(value, Layout):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown layout {value!r}; expected 'discrete' or 'aggregated'"
            ) from None


@dataclass(frozen=True)
class KVBlockSpec:
    """Shape of one page of KV cache: L layers x {K, V} x page_size tokens x heads x dim."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVBlockSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVBlockSpec.dtype {self.dtype!r} unknown; expected one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def segment_bytes(self) -> int:
        """Bytes of K (or V) of one layer for one page: one discrete block."""
        return self.page_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def segments_per_page(self) -> int:
        return 2 * self.layers

    @property
    def page_bytes(self) -> int:
        """Bytes of all layers' K and V for one page: one aggregated block."""
        return self.segments_per_page * self.segment_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    def block_size(self, layout: Layout) -> int:
        return self.page_bytes if layout is Layout.AGGREGATED else self.segment_bytes

    def blocks_per_page(self, layout: Layout) -> int:
        return 1 if layout is Layout.AGGREGATED else self.segments_per_page

    def segment_index(self, layer: int, is_value: bool) -> int:
        """Position of a layer's K or V segment within a page (layer-major, K first)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} outside 0..{self.layers - 1}")
        return 2 * layer + int(is_value)


def aggregate(
    spec: KVBlockSpec, segments: Sequence[Buffer], out: memoryview | None = None
) -> Buffer:
    """Join one page's 2*L discrete blocks into its aggregated block (into `out` if given)."""
    if len(segments) != spec.segments_per_page:
        raise ValueError(
            f"a page has {spec.segments_per_page} discrete blocks, got {len(segments)}"
        )
    seg = spec.segment_bytes
    target = out if out is not None else memoryview(bytearray(spec.page_bytes))
    if len(target) != spec.page_bytes:
        raise ValueError(f"aggregated block is {spec.page_bytes} bytes, target has {len(target)}")
    for i, part in enumerate(segments):
        if len(part) != seg:
            raise ValueError(f"discrete block {i} has {len(part)} bytes, expected {seg}")
        target[i * seg : (i + 1) * seg] = part
    return target


def disaggregate(spec: KVBlockSpec, block: Buffer) -> list[memoryview]:
    """Split an aggregated block into its 2*L discrete blocks (zero-copy views)."""
    if len(block) != spec.page_bytes:
        raise ValueError(f"aggregated block is {spec.page_bytes} bytes, got {len(block)}")
    view = memoryview(block)
    seg = spec.segment_bytes
    return [view[i * seg : (i + 1) * seg] for i in range(spec.segments_per_page)]


def transfer_segments(
    spec: KVBlockSpec, layout: Layout, page_addrs: Sequence[int]
) -> list[tuple[int, int]]:
    """(address, bytes) pieces a transport must move for these blocks: one network call each.

    Discrete: 2*L calls per page; aggregated: one. `page_addrs` holds blocks_per_page
    addresses per page, as the index stores them.
    """
    size = spec.block_size(layout)
    return [(addr, size) for addr in page_addrs]
