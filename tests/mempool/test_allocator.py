"""Block allocator: all-or-nothing, no double or foreign frees, counts conserved."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mempool.address import MemType, block_of, decode, encode
from mempool.allocator import BlockAllocator
from mempool.errors import InvalidAddress, OutOfBlocks


def test_addresses_name_owner_and_are_distinct() -> None:
    alloc = BlockAllocator(7, MemType.HOST, 16)
    addrs = alloc.alloc(16)
    assert len(set(addrs)) == 16
    assert {decode(a).instance for a in addrs} == {7}
    assert sorted(decode(a).block for a in addrs) == list(range(16))


def test_exhaustion_leaves_allocator_unchanged() -> None:
    alloc = BlockAllocator(0, MemType.HOST, 4)
    held = alloc.alloc(3)
    with pytest.raises(OutOfBlocks, match="2 blocks requested, 1 free of 4"):
        alloc.alloc(2)
    assert alloc.num_free == 1 and alloc.num_used == 3
    alloc.free(held)
    assert alloc.num_free == 4


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda a, held: [held[0], held[0]], "twice"),
        (lambda a, held: [encode(1, MemType.HOST, 0)], "instance 1"),
        (lambda a, held: [encode(0, MemType.DEVICE, 0)], "device"),
        (lambda a, held: [encode(0, MemType.HOST, 99)], "beyond the arena"),
        (lambda a, held: [encode(0, MemType.HOST, 3)], "not allocated"),
        (lambda a, held: [-5], "64-bit"),
    ],
)
def test_bad_frees_rejected_whole(bad, message: str) -> None:
    alloc = BlockAllocator(0, MemType.HOST, 4)
    held = alloc.alloc(2)
    with pytest.raises(InvalidAddress, match=message):
        alloc.free([held[1], *bad(alloc, held)])
    assert alloc.num_used == 2  # held[1] was not freed either


def test_double_free_detected() -> None:
    alloc = BlockAllocator(0, MemType.HOST, 4)
    held = alloc.alloc(2)
    alloc.free(held)
    with pytest.raises(InvalidAddress, match="double free"):
        alloc.free(held[:1])


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_reference_model_of_free_counts(ops: list[tuple[bool, int]]) -> None:
    alloc = BlockAllocator(0, MemType.HOST, 12)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            free_before = alloc.num_free
            try:
                held.append(alloc.alloc(n))
            except OutOfBlocks:
                assert n > free_before and alloc.num_free == free_before
        elif held:
            alloc.free(held.pop(n % len(held)))
        in_use = [a for group in held for a in group]
        assert alloc.num_used == len(in_use) == len(set(in_use))
        assert alloc.num_free + alloc.num_used == 12


def test_runs_come_out_ascending_so_transfers_can_merge_them() -> None:
    alloc = BlockAllocator(1, MemType.HOST, 10)
    first = alloc.alloc(4)
    assert [block_of(a) for a in first] == [0, 1, 2, 3]
    assert [block_of(a) for a in alloc.alloc(3)] == [4, 5, 6]
    alloc.free(first)
    assert [block_of(a) for a in alloc.alloc(4)] == [0, 1, 2, 3]


def test_free_known_returns_blocks_in_order_in_one_pass() -> None:
    alloc = BlockAllocator(1, MemType.HOST, 8)
    first, second = alloc.alloc(3), alloc.alloc(2)
    alloc.free_known(first)
    assert alloc.num_used == 2 and alloc.num_free == 6
    assert alloc.alloc(3) == first  # the freed run comes back out in the same order
    alloc.free_known(second)
    assert alloc.owns(first) and not alloc.owns(second)
