"""KV layouts: discrete and aggregated hold the same bytes; aggregation cuts calls by 2*L."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mempool.layout import KVBlockSpec, Layout, aggregate, disaggregate, transfer_segments

specs = st.builds(
    KVBlockSpec,
    layers=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 8),
    dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
    page_size=st.integers(1, 4),
)


@given(specs, st.integers(0, 2**32 - 1))
def test_round_trip_is_exact(spec: KVBlockSpec, seed: int) -> None:
    segments = [os.urandom(spec.segment_bytes) for _ in range(spec.segments_per_page)]
    block = aggregate(spec, segments)
    assert len(block) == spec.page_bytes
    assert [bytes(s) for s in disaggregate(spec, block)] == segments
    assert bytes(aggregate(spec, disaggregate(spec, block))) == bytes(block)


def test_segment_order_is_layer_major_k_first() -> None:
    spec = KVBlockSpec(layers=2, kv_heads=1, head_dim=1, dtype="int8", page_size=1)
    block = aggregate(spec, [b"a", b"b", b"c", b"d"])
    assert bytes(block) == b"abcd"
    assert spec.segment_index(1, is_value=False) == 2
    assert spec.segment_index(1, is_value=True) == 3


def test_aggregation_cuts_network_calls_by_2l() -> None:
    spec = KVBlockSpec(layers=40, kv_heads=40, head_dim=128, dtype="bfloat16", page_size=16)
    pages = 256
    discrete = transfer_segments(spec, Layout.DISCRETE, list(range(pages * 80)))
    aggregated = transfer_segments(spec, Layout.AGGREGATED, list(range(pages)))
    assert len(discrete) / len(aggregated) == 2 * spec.layers
    assert sum(n for _, n in discrete) == sum(n for _, n in aggregated) == pages * spec.page_bytes


def test_sizes_for_a_known_model() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, bf16: 11,520 values = 23,040 B per token.
    spec = KVBlockSpec(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16", page_size=16)
    assert spec.bytes_per_token == 23_040
    assert spec.block_size(Layout.AGGREGATED) == 16 * 23_040
    assert spec.blocks_per_page(Layout.DISCRETE) == 60


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": 0},
        {"kv_heads": -1},
        {"head_dim": 1.5},
        {"dtype": "float64"},
        {"page_size": True},
    ],
)
def test_bad_specs_rejected(kwargs: dict) -> None:
    base = {"layers": 2, "kv_heads": 1, "head_dim": 4, "dtype": "float16", "page_size": 4}
    with pytest.raises(ValueError, match="KVBlockSpec"):
        KVBlockSpec(**{**base, **kwargs})


def test_bad_conversions_rejected() -> None:
    spec = KVBlockSpec(layers=1, kv_heads=1, head_dim=2, dtype="int8", page_size=1)
    with pytest.raises(ValueError, match="2 discrete blocks"):
        aggregate(spec, [b"ab"])
    with pytest.raises(ValueError, match="expected 2"):
        aggregate(spec, [b"abc", b"de"])
    with pytest.raises(ValueError, match="4 bytes"):
        disaggregate(spec, b"abc")
    with pytest.raises(ValueError, match="unknown layout"):
        Layout.parse("tiled")
