"""MemPool API: memory, index and tier calls as an engine uses them, and every refusal."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempool import (
    BlockInUse,
    InsertFlags,
    InvalidAddress,
    InvalidRequest,
    KVBlockSpec,
    MemPool,
    MemPoolError,
    MemType,
    OutOfBlocks,
    decode,
    encode,
)

SPEC = KVBlockSpec(layers=2, kv_heads=1, head_dim=4, dtype="float16", page_size=4)


@pytest.fixture
def pool() -> Iterator[MemPool]:
    p = MemPool(3, SPEC, host_blocks=32, device_blocks=16)
    yield p
    p.close()


def fill(pool: MemPool, addrs: list[int]) -> list[bytes]:
    """Give each block distinct random bytes, as a prefill would."""
    data = [os.urandom(pool.block_size) for _ in addrs]
    for addr, payload in zip(addrs, data, strict=True):
        pool.write_block(addr, payload)
    return data


def free_counts(pool: MemPool) -> dict[str, int]:
    return {name: tier["free"] for name, tier in pool.stats()["tiers"].items()}


def test_alloc_rounds_bytes_up_to_blocks_and_names_owner(pool: MemPool) -> None:
    addrs = pool.alloc_mem(pool.block_size + 1, "device", 3)
    assert len(addrs) == 2
    assert all(decode(a).instance == 3 and decode(a).mem_type is MemType.DEVICE for a in addrs)
    pool.free_mem(addrs)
    assert free_counts(pool) == {"host": 32, "device": 16}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), "positive number of bytes"),
        ((-8,), "positive number of bytes"),
        ((1.5,), "positive number of bytes"),
        (("64",), "positive number of bytes"),
        ((64, "hbm"), "unknown memory type"),
        ((64, MemType.HOST, 4), "instance 4"),
    ],
)
def test_alloc_bad_arguments(pool: MemPool, args: tuple, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        pool.alloc_mem(*args)
    assert free_counts(pool) == {"host": 32, "device": 16}


def test_alloc_beyond_arena_and_exhaustion(pool: MemPool) -> None:
    with pytest.raises(InvalidRequest, match="has only 16"):
        pool.alloc_mem(17 * pool.block_size, "device")
    held = pool.alloc_blocks(10, "device")
    with pytest.raises(OutOfBlocks, match="7 blocks requested, 6 free"):
        pool.alloc_blocks(7, "device")
    assert free_counts(pool)["device"] == 6
    pool.free_mem(held)


def test_missing_tier_is_clear() -> None:
    host_only = MemPool(0, SPEC, host_blocks=4)
    with pytest.raises(InvalidRequest, match="no device tier"):
        host_only.alloc_blocks(1, "device")
    with pytest.raises(InvalidRequest, match="both a device and a host tier"):
        host_only.swap_out(1)
    with pytest.raises(InvalidRequest, match="needs host_blocks or device_blocks"):
        MemPool(0, SPEC, host_blocks=0)


@pytest.mark.parametrize(
    ("addrs", "error", "message"),
    [
        ([], InvalidRequest, "empty"),
        (5, InvalidRequest, "list of addresses"),
        ([encode(9, MemType.HOST, 0)], InvalidAddress, "instance 9"),
        (["x"], InvalidAddress, "int"),
    ],
)
def test_free_bad_lists(pool: MemPool, addrs: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        pool.free_mem(addrs)  # type: ignore[arg-type]


def test_free_is_all_or_nothing_across_tiers(pool: MemPool) -> None:
    host = pool.alloc_blocks(2, "host")
    dev = pool.alloc_blocks(2, "device")
    pool.free_mem(host[:1])
    with pytest.raises(InvalidAddress, match="not allocated"):
        pool.free_mem([dev[0], host[1], host[0]])
    assert free_counts(pool) == {"host": 31, "device": 14}
    pool.free_mem([dev[0], host[1], dev[1]])
    assert free_counts(pool) == {"host": 32, "device": 16}
    with pytest.raises(InvalidAddress, match="double free"):
        pool.free_mem(dev[:1])


def test_context_caching_round(pool: MemPool) -> None:
    """A request prefills, finishes (insert), and the next turn matches its pages."""
    prompt = list(range(100, 114))  # 3 whole pages + 2 tokens
    blocks = pool.alloc_blocks(4, "device")  # the 4th holds the partial page
    data = fill(pool, blocks)
    result = pool.insert(prompt, blocks[:3])
    assert (result.existing_tokens, result.new_tokens) == (0, 12)
    pool.free_mem(blocks[3:])  # the partial page's block stays with the engine
    turn2 = prompt + [7, 8, 9]
    found = pool.match(turn2, lock=True)
    assert found.num_tokens == 12 and found.addrs == blocks[:3]
    assert [pool.read_block(a) for a in found.addrs] == data[:3]
    with pytest.raises(BlockInUse):
        pool.free_mem(found.addrs)  # indexed blocks are not the caller's to free
    more = pool.alloc_blocks(2, "device")
    pool.insert(turn2 + [1, 2, 3], found.addrs + more)  # 5 pages: 3 cached + 2 new
    pool.release(found)
    assert pool.match(turn2 + [1, 2, 3]).num_tokens == 20
    assert pool.stats()["cached_tokens"] == 20


def test_duplicate_pages_are_freed_unless_kept(pool: MemPool) -> None:
    prompt = list(range(8))
    first = pool.alloc_blocks(2)
    pool.insert(prompt, first)
    second = pool.alloc_blocks(2)  # the same prompt computed again in parallel
    result = pool.insert(prompt, second)
    assert result.duplicates == second
    assert free_counts(pool)["host"] == 30
    third = pool.alloc_blocks(2)
    pool.insert(prompt, third, InsertFlags.KEEP_DUPLICATES)
    assert free_counts(pool)["host"] == 28  # still the caller's
    pool.free_mem(third)


def test_insert_refusals_change_nothing(pool: MemPool) -> None:
    prompt = list(range(8))
    blocks = pool.alloc_blocks(2)
    with pytest.raises(ValueError, match="expected 2 addresses"):
        pool.insert(prompt, blocks[:1])
    with pytest.raises(InvalidAddress, match="not allocated"):
        pool.insert(prompt, [blocks[0], encode(3, MemType.HOST, 31)])
    with pytest.raises(TypeError, match="token"):
        pool.insert(["a"] * 8, blocks)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty"):
        pool.insert([], blocks)
    assert pool.stats()["cached_tokens"] == 0
    pool.insert(prompt, blocks)
    other = pool.alloc_blocks(2)
    with pytest.raises(BlockInUse, match="already caches other tokens"):
        pool.insert(list(range(50, 58)), [other[0], blocks[1]])  # block reused for new tokens
    assert pool.match(list(range(50, 58))).num_tokens == 0
    pool.free_mem(other)


def test_lock_protects_from_eviction_and_flush(pool: MemPool) -> None:
    a, b = list(range(8)), list(range(50, 58))
    pool.insert(a, pool.alloc_blocks(2))
    b_blocks = pool.alloc_blocks(2)
    pool.insert(b, b_blocks)
    held = pool.match(a, lock=True)
    with pytest.raises(BlockInUse, match="locked"):
        pool.flush()
    assert sorted(pool.evict(100)) == sorted(b_blocks)  # only b's pages go
    assert pool.match(a).num_tokens == 8 and pool.match(b).num_tokens == 0
    pool.release(held)
    with pytest.raises(InvalidRequest, match="not locked"):
        pool.release(held)
    assert len(pool.flush()) == 2
    assert free_counts(pool) == {"host": 32, "device": 16}


def test_delete_frees_the_prompt_blocks(pool: MemPool) -> None:
    shared = list(range(8))
    pool.insert(shared + [1, 1, 1, 1], pool.alloc_blocks(3))
    pool.insert(shared + [2, 2, 2, 2], pool.match(shared).addrs + pool.alloc_blocks(1))
    assert len(pool.delete(shared + [1, 1, 1, 1])) == 1
    assert pool.match(shared + [2, 2, 2, 2]).num_tokens == 12
    assert len(pool.delete(shared + [2, 2, 2, 2])) == 3
    assert free_counts(pool)["host"] == 32


def test_swap_out_and_in_keep_bytes_and_index(pool: MemPool) -> None:
    old, new = list(range(8)), list(range(40, 48))
    old_blocks = pool.alloc_blocks(2, "device")
    old_data = fill(pool, old_blocks)
    pool.insert(old, old_blocks)
    pool.insert(new, pool.alloc_blocks(2, "device"))
    pool.match(new)  # old is now least recently used
    moved = pool.swap_out(2)
    assert all(decode(a).mem_type is MemType.HOST for a in moved)
    found = pool.match(old)
    assert found.addrs == moved
    assert [pool.read_block(a) for a in found.addrs] == old_data
    assert all(decode(a).mem_type is MemType.DEVICE for a in pool.match(new).addrs)
    back = pool.swap_in(found.addrs)
    assert pool.match(old).addrs == back
    assert [pool.read_block(a) for a in back] == old_data
    assert free_counts(pool) == {"host": 32, "device": 12}


def test_swap_out_takes_least_recent_suffixes_before_their_prefix(pool: MemPool) -> None:
    """Eviction's order: the idle branch, then the other branch, the shared prefix last."""
    shared = [9, 9, 9, 9]
    a, b = shared + [1, 1, 1, 1], shared + [2, 2, 2, 2]
    pool.insert(a, pool.alloc_blocks(2, "device"))
    pool.insert(b, pool.match(shared).addrs + pool.alloc_blocks(1, "device"))
    pool.match(b)  # a's own page is now the least recently used
    data = {addr: fill(pool, [addr])[0] for addr in pool.match(a).addrs + pool.match(b).addrs}
    prefix, own_a, own_b = pool.match(a).addrs + pool.match(b).addrs[1:]
    moved = pool.swap_out(2)
    assert pool.match(a).addrs == [prefix, moved[0]]
    assert pool.match(b).addrs == [prefix, moved[1]]
    assert pool.is_indexed(moved[0]) and not pool.is_indexed(own_a)
    assert [pool.read_block(m) for m in moved] == [data[own_a], data[own_b]]
    assert pool.swap_out(1) == [pool.match(a).addrs[0]]  # then the prefix
    assert free_counts(pool) == {"host": 29, "device": 16}


def test_swap_skips_locked_and_refuses_when_host_full() -> None:
    pool = MemPool(0, SPEC, host_blocks=1, device_blocks=8)
    pool.insert(list(range(8)), pool.alloc_blocks(2, "device"))
    held = pool.match(list(range(8)), lock=True)
    assert pool.swap_out(2) == []  # everything historical is locked
    pool.release(held)
    with pytest.raises(OutOfBlocks):
        pool.swap_out(2)
    assert all(decode(a).mem_type is MemType.DEVICE for a in pool.match(list(range(8))).addrs)
    assert free_counts(pool) == {"host": 1, "device": 6}


def test_swap_in_refuses_device_or_foreign_blocks(pool: MemPool) -> None:
    dev = pool.alloc_blocks(1, "device")
    with pytest.raises(InvalidAddress, match="host blocks"):
        pool.swap_in(dev)
    with pytest.raises(InvalidAddress):
        pool.swap_in([encode(3, MemType.HOST, 5)])  # not allocated


def test_block_io_refusals(pool: MemPool) -> None:
    (addr,) = pool.alloc_blocks(1)
    with pytest.raises(InvalidAddress, match="not an allocated block"):
        pool.read_block(encode(3, MemType.HOST, 30))
    with pytest.raises(Exception, match="block size"):
        pool.write_block(addr, b"short")


def test_discrete_layout_indexes_2l_blocks_per_page() -> None:
    pool = MemPool(0, SPEC, host_blocks=16, layout="discrete")
    assert pool.blocks_per_page == 2 * SPEC.layers
    prompt = list(range(8))
    blocks = pool.alloc_blocks(8)
    pool.insert(prompt, blocks)
    assert pool.match(prompt + [1]).addrs == blocks
    with pytest.raises(ValueError, match="expected 8 addresses"):
        pool.insert(list(range(20, 28)), pool.alloc_blocks(2))


# Prompts of three pages that share first pages in several ways (random-use tests).
PROMPTS = [[i % 3] * 4 + [i] * 4 + [j] * 4 for i in range(3) for j in range(2)]


def finish(
    pool: MemPool, prompt: list[int], tier: str, page: Callable[[list[int]], bytes] | None = None
) -> None:
    """A request over `prompt` finishes: blocks for its pages not cached yet (their bytes
    `page(tokens so far)` if given), then insert; short of memory, evict and give up."""
    cached = pool.match(prompt)
    need = 3 - len(cached.addrs)
    try:
        fresh = pool.alloc_blocks(need, tier) if need else []
    except OutOfBlocks:
        pool.evict(need, tier)
        return
    if page is not None:
        for i, addr in enumerate(fresh, start=len(cached.addrs)):
            pool.write_block(addr, page(prompt[: 4 * (i + 1)]))
    pool.insert(prompt, cached.addrs + fresh)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "match_lock", "release", "evict", "delete"]),
            st.integers(0, 5),
        ),
        max_size=30,
    )
)
@settings(max_examples=60, deadline=None)
def test_no_block_leaks_under_random_use(ops: list[tuple[str, int]]) -> None:
    """Whatever the engine does, released state returns every block to the free lists."""
    pool = MemPool(0, SPEC, host_blocks=64)
    held = []
    for op, k in ops:
        prompt = PROMPTS[k % len(PROMPTS)]
        if op == "insert":
            finish(pool, prompt, "host")
        elif op == "match_lock":
            held.append(pool.match(prompt, lock=True))
        elif op == "release" and held:
            pool.release(held.pop(k % len(held)))
        elif op == "evict":
            pool.evict(k + 1)
        elif op == "delete":
            try:
                pool.delete(prompt)
            except BlockInUse:
                assert pool.index.protected_pages > 0
        stats = pool.stats()["tiers"]["host"]
        assert stats["used"] == pool.index.num_pages
    for match in held:
        pool.release(match)
    pool.flush()
    assert free_counts(pool) == {"host": 64}


def test_insert_refuses_one_block_for_two_pages(pool: MemPool) -> None:
    (block,) = pool.alloc_blocks(1)
    with pytest.raises(InvalidRequest, match="same block for two pages"):
        pool.insert(list(range(8)), [block, block])
    assert pool.stats()["cached_tokens"] == 0
    pool.free_mem([block])
    assert free_counts(pool) == {"host": 32, "device": 16}


def test_every_refusal_is_a_mempool_error(pool: MemPool) -> None:
    for call in (
        lambda: pool.insert(["x"] * 8, pool.alloc_blocks(2)),  # type: ignore[list-item]
        lambda: pool.match([]),
        lambda: pool.insert(list(range(8)), pool.alloc_blocks(1)),
    ):
        with pytest.raises(MemPoolError):
            call()


def test_close_with_live_views_is_refused_and_pool_stays_usable() -> None:
    pool = MemPool(0, SPEC, host_blocks=4)
    (block,) = pool.alloc_blocks(1)
    view = pool.view_block(block)
    with pytest.raises(MemPoolError, match="views"):
        pool.close()
    pool.write_block(block, bytes(pool.block_size))
    view.release()
    pool.close()


def test_unreserved_arena_stays_virtual_until_written() -> None:
    big = KVBlockSpec(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    pool = MemPool(0, big, host_blocks=4096, huge_pages="off", reserve=False)  # 8 GiB virtual
    (addr,) = pool.alloc_blocks(1)
    pool.view_block(addr)[:8] = b"stamped!"
    assert pool.read_block(addr)[:8] == b"stamped!"
    status = Path("/proc/self/status").read_text().splitlines()
    rss_kib = int(next(x for x in status if x.startswith("VmRSS")).split()[1])
    assert rss_kib < 4 * 1024 * 1024  # far below the 8 GiB mapped
    pool.close()


def test_insert_with_lock_keeps_a_running_request_s_pages(pool: MemPool) -> None:
    """Chunked prefill: the request caches what it has so far and keeps it pinned."""
    chunk = list(range(8))
    result = pool.insert(chunk, pool.alloc_blocks(2), InsertFlags.LOCK)
    assert pool.evict(10) == [] and pool.index.protected_pages == 2
    pool.release(result)
    assert len(pool.evict(10)) == 2
    assert free_counts(pool)["host"] == 32


def test_region_and_offset_name_the_same_bytes(pool: MemPool) -> None:
    addrs = pool.alloc_blocks(3, MemType.DEVICE)
    data = fill(pool, addrs)
    region = pool.region(MemType.DEVICE)
    for addr, payload in zip(addrs, data, strict=True):
        mem_type, offset = pool.offset_of(addr)
        assert mem_type == MemType.DEVICE
        assert bytes(region[offset : offset + pool.block_size]) == payload
    assert pool.region_base(MemType.HOST) != pool.region_base(MemType.DEVICE)
    pool.free_mem(addrs)
    with pytest.raises(InvalidAddress, match="not an allocated block"):
        pool.offset_of(addrs[0])


# ----------------------------------------------------------------- two tiers (hierarchical)

DEVICE, HOST = int(MemType.DEVICE), int(MemType.HOST)


def tiered(device: int = 8, host: int = 8) -> MemPool:
    from tests.mempool.test_radix_incremental import Ticker

    return MemPool(0, SPEC, host_blocks=host, device_blocks=device, clock=Ticker())


def check_tiers(pool: MemPool) -> None:
    """Every node lives in one tier, the heaps hold exactly the tier leaves, and every block
    in use is indexed (no request holds any here)."""
    nodes = list(pool.index.nodes())
    for node in nodes:
        assert node.value is not None
        assert {decode(a).mem_type for a in node.value} == {MemType(node.tier)}
    leaves = {
        id(n) for n in nodes if not n.lock_ref and all(c.tier > n.tier for c in n.children.values())
    }
    assert {id(n) for n in nodes if n.lru_stamp} == leaves
    indexed = sum(len(n.value) for n in nodes if n.value is not None)
    used = sum(t["used"] for t in pool.stats()["tiers"].values())
    assert used == indexed == pool.index.num_pages


def test_swap_out_moves_exactly_and_splits_a_node_to_move_its_tail() -> None:
    pool = tiered()
    prompt = list(range(16))  # 4 pages, one node
    blocks = pool.alloc_blocks(4, "device")
    data = fill(pool, blocks)
    pool.insert(prompt, blocks)
    runs = pool.swap_out_runs(1)
    assert [len(r.new) for r in runs] == [1] and runs[0].old == blocks[3:]
    assert runs[0].tokens.tolist() == prompt[12:]  # the last page moved: device stays above
    found = pool.match(prompt)
    assert [decode(a).mem_type for a in found.addrs] == [MemType.DEVICE] * 3 + [MemType.HOST]
    assert [pool.read_block(a) for a in found.addrs] == data
    assert pool.swap_out(2) == pool.match(prompt).addrs[1:3]  # then the pages above it
    check_tiers(pool)


def test_host_is_dropped_before_device_and_only_leaves() -> None:
    pool = tiered(device=4, host=4)
    a, b = list(range(8)), list(range(50, 58))
    pool.insert(a, pool.alloc_blocks(2, "device"))
    pool.swap_out(1)
    pool.swap_out(1)  # a now on the host, one node a page
    pool.insert(b, pool.alloc_blocks(2, "device"))
    freed = pool.evict(1)
    assert all(decode(x).mem_type is MemType.HOST for x in freed)
    assert pool.match(a).num_tokens == 4 and pool.match(b).num_tokens == 8
    assert len(pool.evict(10, "host")) == 1 and pool.match(a).num_tokens == 0
    assert pool.evict(10, "host") == [] and pool.match(b).num_tokens == 8
    assert len(pool.evict(10)) == 2  # nothing left on the host: the device goes
    assert free_counts(pool) == {"host": 4, "device": 4}


def test_swap_in_match_brings_host_pages_back_pinned() -> None:
    pool = tiered()
    prompt = list(range(12))
    blocks = pool.alloc_blocks(3, "device")
    data = fill(pool, blocks)
    pool.insert(prompt, blocks)
    pool.swap_out(3)
    found = pool.match(prompt + [99], lock=True)
    runs = pool.swap_in_match(found)
    assert sum(len(r.new) for r in runs) == 3 and found.addrs == [a for r in runs for a in r.new]
    assert all(decode(a).mem_type is MemType.DEVICE for a in found.addrs)
    assert [pool.read_block(a) for a in found.addrs] == data
    assert pool.swap_out(3) == []  # pinned by the match
    pool.release(found)
    assert len(pool.swap_out(3)) == 3
    check_tiers(pool)


def test_swap_in_match_leaves_pages_another_lock_reads() -> None:
    pool = tiered()
    shared, own = list(range(8)), list(range(8, 12))
    pool.insert(shared + own, pool.alloc_blocks(3, "device"))
    pool.swap_out(3)
    reader = pool.match(shared, lock=True)  # e.g. a peer pulling these host pages
    before = list(reader.addrs)
    found = pool.match(shared + own, lock=True)
    assert pool.swap_in_match(found) == [] and found.addrs == [] and found.num_tokens == 0
    assert pool.match(shared).addrs == before  # the reader's blocks did not move
    pool.release(reader)
    assert len(pool.swap_in_match(found)) == 2 and found.num_tokens == 12
    pool.release(found)
    check_tiers(pool)


def test_swap_in_match_is_all_or_nothing_when_the_device_is_full() -> None:
    pool = tiered(device=2, host=4)
    prompt = list(range(8))
    pool.insert(prompt, pool.alloc_blocks(2, "device"))
    pool.swap_out(2)
    held = pool.alloc_blocks(1, "device")
    found = pool.match(prompt, lock=True)
    with pytest.raises(OutOfBlocks):
        pool.swap_in_match(found)
    assert all(decode(a).mem_type is MemType.HOST for a in found.addrs)
    pool.release(found)
    pool.free_mem(held)
    check_tiers(pool)


def test_insert_adopts_a_device_copy_of_host_pages() -> None:
    """A request recomputed pages the index holds on the host: its device blocks win."""
    pool = tiered()
    prompt = list(range(8))
    pool.insert(prompt, pool.alloc_blocks(2, "device"))
    pool.swap_out(2)
    fresh = pool.alloc_blocks(3, "device")
    data = fill(pool, fresh)
    result = pool.insert(prompt + [1, 2, 3, 4], fresh)
    assert result.duplicates == [] and pool.match(prompt + [1, 2, 3, 4]).addrs == fresh
    assert [pool.read_block(a) for a in fresh] == data
    assert free_counts(pool) == {"host": 8, "device": 5}
    check_tiers(pool)


def test_insert_of_mixed_tiers_splits_into_one_node_per_tier() -> None:
    pool = tiered()
    dev, host = pool.alloc_blocks(2, "device"), pool.alloc_blocks(2, "host")
    pool.insert(list(range(16)), dev + host)
    assert [n.tier for n in pool.index.nodes()] == [DEVICE, HOST]
    check_tiers(pool)
    moved = pool.swap_out(2)  # the device pages above the host ones are next
    assert pool.match(list(range(16))).addrs == moved + host
    check_tiers(pool)


def test_swap_out_cost_follows_what_it_moves() -> None:
    """Thousands of pages already on the host are not walked to find the next device page."""
    from tests.mempool.test_radix_incremental import NoWholeTreeWalk

    pool = tiered(device=8, host=4096)
    for i in range(3000):
        pool.insert([i, i, i, i], pool.alloc_blocks(1, "device"))
        pool.swap_out(1)
    pool.insert([9999] * 4, pool.alloc_blocks(1, "device"))
    with NoWholeTreeWalk(pool.index):
        (moved,) = pool.swap_out(1)
        freed = pool.evict(2, "host")
    assert pool.match([9999] * 4).addrs == [moved]
    assert len(freed) == 2 and pool.match([0] * 4).num_tokens == 0  # the oldest host leaf
    assert pool.index._heap_size(HOST) <= 2 * pool.index._queued_leaves + 64


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["insert", "lock", "release", "swap_out", "swap_in", "evict", "delete"]
            ),
            st.integers(0, 5),
        ),
        max_size=40,
    )
)
@settings(max_examples=80, deadline=None)
def test_tiers_stay_consistent_under_random_use(ops: list[tuple[str, int]]) -> None:
    """Random engine use of a two-tier pool: tiers, heaps and block counts stay exact, every
    page keeps its bytes wherever it moves, and releasing everything frees every block."""
    pool = tiered(device=6, host=6)
    held = []
    stamps: dict[tuple[int, ...], bytes] = {}

    def page_bytes(tokens: list[int]) -> bytes:
        return bytes(tokens) + bytes(pool.block_size - len(tokens))

    for op, k in ops:
        prompt = PROMPTS[k % len(PROMPTS)]
        if op == "insert":
            finish(pool, prompt, "device", page_bytes)
        elif op == "lock":
            found = pool.match(prompt, lock=True)
            with contextlib.suppress(OutOfBlocks):
                pool.swap_in_match(found)
            held.append(found)
        elif op == "release" and held:
            pool.release(held.pop(k % len(held)))
        elif op == "swap_out":
            try:
                pool.swap_out(k + 1)
            except OutOfBlocks:
                pool.evict(k + 1, "host")
        elif op == "swap_in":
            found = pool.match(prompt, lock=True)
            with contextlib.suppress(OutOfBlocks):
                pool.swap_in_match(found)
            pool.release(found)
        elif op == "evict":
            pool.evict(k + 1, [None, "host", "device"][k % 3])
        elif op == "delete":
            try:
                pool.delete(prompt)
            except BlockInUse:
                assert pool.index.protected_pages > 0
        for tokens, addrs in pool.index.sequences():
            for i, addr in enumerate(addrs):
                head = tokens[: 4 * (i + 1)]
                assert pool.read_block(addr) == stamps.setdefault(head, page_bytes(list(head)))
        if not held:
            check_tiers(pool)
    for match in held:
        pool.release(match)
    check_tiers(pool)
    pool.flush()
    assert free_counts(pool) == {"host": 6, "device": 6}
