"""Addresses name their owner: instance, tier and block survive a round trip."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mempool.address import MAX_BLOCKS, MAX_INSTANCE_ID, MemType, decode, encode


@given(
    st.integers(0, MAX_INSTANCE_ID), st.sampled_from(list(MemType)), st.integers(0, MAX_BLOCKS - 1)
)
def test_round_trip(instance: int, mem_type: MemType, block: int) -> None:
    assert decode(encode(instance, mem_type, block)) == (instance, mem_type, block)


@pytest.mark.parametrize("bad", [-1, 1 << 64, 0, "0x10", 1.0, True])
def test_decode_rejects_non_addresses(bad: object) -> None:
    with pytest.raises(ValueError):
        decode(bad)  # type: ignore[arg-type]


def test_encode_rejects_out_of_range_fields() -> None:
    with pytest.raises(ValueError, match="instance id"):
        encode(MAX_INSTANCE_ID + 1, MemType.HOST, 0)
    with pytest.raises(ValueError, match="block index"):
        encode(0, MemType.HOST, MAX_BLOCKS)


@pytest.mark.parametrize(
    ("given_", "expected"), [("host", MemType.HOST), ("DEVICE", MemType.DEVICE), (2, MemType.HOST)]
)
def test_memtype_parse(given_: object, expected: MemType) -> None:
    assert MemType.parse(given_) is expected


@pytest.mark.parametrize("bad", ["hbm", 7, None, True])
def test_memtype_parse_rejects_unknown(bad: object) -> None:
    with pytest.raises(ValueError, match="unknown memory type"):
        MemType.parse(bad)
