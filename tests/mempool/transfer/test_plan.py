"""Byte plans between layouts, page sizes and head shares, checked against a reference that
reads the layout definition directly (tests/mempool/transfer/kv.py), plus merging figures."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempool import InvalidRequest, KVBlockSpec
from mempool.transfer.base import Segment
from mempool.transfer.plan import KVGeometry, check_compatible, plan_segments

from .kv import logical_kv

HOST = 2


class Arena:
    """A byte arena of numbered blocks standing in for a pool tier."""

    def __init__(self, geo: KVGeometry, blocks: int) -> None:
        self.geo = geo
        self.data = bytearray(os.urandom(blocks * geo.block_size))

    def locs(self, ids: list[int]) -> list[tuple[int, int]]:
        return [(HOST, i * self.geo.block_size) for i in ids]

    def read(self, i: int) -> bytes:
        bs = self.geo.block_size
        return bytes(self.data[i * bs : (i + 1) * bs])


def copy(src: Arena, dst: Arena, segments: list[Segment]) -> None:
    for s in segments:
        dst.data[s.dst_offset : s.dst_offset + s.length] = src.data[
            s.src_offset : s.src_offset + s.length
        ]


def logical(arena: Arena, ids: list[int], tokens: range, heads, layers=None, first=0) -> bytes:
    g = arena.geo
    return logical_kv(g.spec, g.layout, arena.read, ids, tokens, heads, g.head_start, layers, first)


# (source, destination, tokens, first token sent, layers sent, randomness)
Case = tuple[KVGeometry, KVGeometry, int, int, range, random.Random]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layers = draw(st.integers(1, 3))
    total_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(["float16", "float32", "int8"]))

    def side(allow_partial: bool) -> KVGeometry:
        page = draw(st.sampled_from([1, 2, 4, 8]))
        layout = draw(st.sampled_from(["discrete", "aggregated"]))
        start = draw(st.integers(0, total_heads - 1)) if allow_partial else 0
        count = draw(st.integers(1, total_heads - start)) if allow_partial else total_heads
        return KVGeometry(layers, count, head_dim, dtype, page, layout, start, total_heads)

    src = side(True)
    dst = side(True)
    if max(src.head_start, dst.head_start) >= min(src.heads[1], dst.heads[1]):
        dst = KVGeometry(layers, total_heads, head_dim, dtype, dst.page_size, dst.layout, 0, 0)
    num_tokens = draw(st.integers(1, 40))
    t0 = draw(st.integers(0, num_tokens - 1))
    l0 = draw(st.integers(0, layers - 1))
    l1 = draw(st.integers(l0 + 1, layers))
    return src, dst, num_tokens, t0, range(l0, l1), draw(st.randoms(use_true_random=False))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_plan_moves_exactly_the_bytes_the_layout_defines(case: Case) -> None:
    src_geo, dst_geo, n, t0, layers, rnd = case
    src_pages = src_geo.pages_for(n)
    # the destination holds pages from the one containing t0 (incremental sends start there)
    dst_first = t0 // dst_geo.page_size * dst_geo.page_size
    dst_pages = dst_geo.pages_for(n) - dst_first // dst_geo.page_size
    src = Arena(src_geo, src_pages * src_geo.blocks_per_page + 3)
    dst = Arena(dst_geo, dst_pages * dst_geo.blocks_per_page + 3)
    src_ids = rnd.sample(
        range(src_pages * src_geo.blocks_per_page + 3), src_pages * src_geo.blocks_per_page
    )
    dst_ids = rnd.sample(
        range(dst_pages * dst_geo.blocks_per_page + 3), dst_pages * dst_geo.blocks_per_page
    )
    before = bytes(dst.data)
    segments = plan_segments(
        src_geo, src.locs(src_ids), 0, dst_geo, dst.locs(dst_ids), dst_first, (t0, n), layers
    )
    copy(src, dst, segments)
    heads = (max(src_geo.head_start, dst_geo.head_start), min(src_geo.heads[1], dst_geo.heads[1]))
    tokens = range(t0, n)
    assert logical(dst, dst_ids, tokens, heads, layers, dst_first) == logical(
        src, src_ids, tokens, heads, layers
    )
    # nothing outside the planned bytes changed: recompute with the old bytes restored there
    written = bytearray(len(before))
    for s in segments:
        written[s.dst_offset : s.dst_offset + s.length] = b"\1" * s.length
    untouched = [i for i in range(len(before)) if not written[i]]
    assert all(dst.data[i] == before[i] for i in untouched)
    assert sum(s.length for s in segments) == len(tokens) * len(layers) * 2 * (
        heads[1] - heads[0]
    ) * dst_geo.head_dim * (dst_geo.row_bytes // dst_geo.kv_heads // dst_geo.head_dim)


LLAMA13B = KVBlockSpec(layers=40, kv_heads=40, head_dim=128, dtype="float16", page_size=16)


def test_aggregation_divides_calls_by_2L_for_one_request() -> None:
    """MemServe 5.2: a 2,048-token request of Llama-2-13B, one call per block, no merging."""
    disc = KVGeometry.of(LLAMA13B, "discrete")
    agg = KVGeometry.of(LLAMA13B, "aggregated")
    pages = 2048 // 16
    ids = list(range(0, 4 * pages * 80, 4))  # scattered blocks: nothing contiguous
    by_request = plan_segments(
        disc,
        [(HOST, i * disc.block_size) for i in ids],
        0,
        disc,
        [(HOST, i * disc.block_size) for i in ids],
        0,
        (0, 2048),
        merge=False,
    )
    agg_ids = ids[:pages]
    by_request_agg = plan_segments(
        agg,
        [(HOST, i * agg.block_size) for i in agg_ids],
        0,
        agg,
        [(HOST, i * agg.block_size) for i in agg_ids],
        0,
        (0, 2048),
        merge=False,
    )
    assert len(by_request) == pages * 2 * 40
    assert len(by_request_agg) == pages
    assert len(by_request) // len(by_request_agg) == 2 * LLAMA13B.layers
    assert sum(s.length for s in by_request) == sum(s.length for s in by_request_agg)


def test_merging_joins_blocks_contiguous_on_both_sides() -> None:
    disc = KVGeometry.of(LLAMA13B, "discrete")
    agg = KVGeometry.of(LLAMA13B, "aggregated")
    pages = 8
    contiguous_disc = [(HOST, i * disc.block_size) for i in range(pages * 80)]
    contiguous_agg = [(HOST, i * agg.block_size) for i in range(pages)]
    # discrete blocks allocated in page order land exactly where an aggregated page would
    assert len(plan_segments(disc, contiguous_disc, 0, agg, contiguous_agg, 0, (0, 128))) == 1
    assert len(plan_segments(agg, contiguous_agg, 0, agg, contiguous_agg, 0, (0, 128))) == 1
    # one hole on the destination side splits the run in two
    holed = contiguous_agg[:3] + [(HOST, 100 * agg.block_size)] + contiguous_agg[4:]
    assert len(plan_segments(agg, contiguous_agg, 0, agg, holed, 0, (0, 128))) == 3
    # by layer: each layer of each page is its own run (K and V of a layer merge)
    by_layer = [
        plan_segments(agg, contiguous_agg, 0, agg, contiguous_agg, 0, (0, 128), range(i, i + 1))
        for i in range(40)
    ]
    assert [len(p) for p in by_layer] == [pages] * 40
    assert all(s.length == 2 * agg.segment_bytes for p in by_layer for s in p)


def test_tensor_parallel_receiver_gets_only_its_heads() -> None:
    full = KVGeometry(2, 4, 2, "float16", 4, "aggregated", 0, 4)
    rank1 = KVGeometry(2, 2, 2, "float16", 4, "aggregated", 2, 4)
    check_compatible(full, rank1, cover_dst=True)
    segments = plan_segments(full, [(HOST, 0)], 0, rank1, [(HOST, 0)], 0, (0, 4))
    # per token: one run of 2 heads x 2 dims x 2 bytes, from byte 8 of the sender's row
    assert {s.length for s in segments} == {8}
    assert segments[0].src_offset == 8 and segments[0].dst_offset == 0
    with pytest.raises(InvalidRequest, match="only"):
        check_compatible(rank1, full, cover_dst=True)
    check_compatible(rank1, full, cover_dst=False)  # it may fill its share of given blocks


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        (
            KVGeometry(2, 4, 2, "float16", 4, "discrete"),
            KVGeometry(3, 4, 2, "float16", 4, "discrete"),
            "layers",
        ),
        (
            KVGeometry(2, 4, 2, "float16", 4, "discrete"),
            KVGeometry(2, 4, 2, "float32", 4, "discrete"),
            "dtype",
        ),
        (
            KVGeometry(2, 4, 2, "float16", 4, "discrete"),
            KVGeometry(2, 4, 4, "float16", 4, "discrete"),
            "head_dim",
        ),
        (
            KVGeometry(2, 2, 2, "float16", 4, "discrete", 0, 4),
            KVGeometry(2, 2, 2, "float16", 4, "discrete", 2, 4),
            "disjoint",
        ),
        (
            KVGeometry(2, 4, 2, "float16", 4, "discrete"),
            KVGeometry(2, 4, 2, "float16", 4, "discrete", 0, 8),
            "not one model",
        ),
    ],
)
def test_incompatible_geometries_are_refused(
    src: KVGeometry, dst: KVGeometry, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_compatible(src, dst, cover_dst=False)


def test_plan_refuses_ranges_the_blocks_do_not_hold() -> None:
    g = KVGeometry(1, 1, 1, "int8", 4, "aggregated")
    one_page = [(HOST, 0)]
    with pytest.raises(InvalidRequest, match="up to 4, 5 needed"):
        plan_segments(g, one_page, 0, g, one_page + one_page, 0, (0, 5))
    with pytest.raises(InvalidRequest, match="page boundary"):
        plan_segments(g, one_page, 0, g, one_page, 2, (2, 4))
    with pytest.raises(InvalidRequest, match="whole number of pages"):
        d = KVGeometry(1, 1, 1, "int8", 4, "discrete")
        plan_segments(d, one_page, 0, g, one_page, 0, (0, 4))
    with pytest.raises(InvalidRequest, match="layers"):
        plan_segments(g, one_page, 0, g, one_page, 0, (0, 4), range(0, 2))
    with pytest.raises(InvalidRequest, match="do not fit"):
        KVGeometry(1, 3, 1, "int8", 4, "aggregated", 2, 4)
    with pytest.raises(ValueError, match="layout"):
        KVGeometry(1, 1, 1, "int8", 4, "paged")
