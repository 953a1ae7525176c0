"""The worker's host tier and chunked prefill in one process: KVCache, Admission and the
Scheduler on a real two-tier MemPool with the sim backend's stand-in pages (bytes stamped and
checked wherever they move), driven as the HTTP server drives them."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest

from connector.worker.admission import Admission
from connector.worker.backend_sim import SimBackend
from connector.worker.kv_cache import KVCache
from connector.worker.protocol import GenerateInput
from connector.worker.scheduler import Scheduler, SchedulerConfig
from connector.worker.sequence import DONE, SamplingParams, Sequence
from mempool import MemPool, MemType, decode
from shared.tokenizer import ChatTokenizer

PAGE = 16


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def make_kv(tokenizer: ChatTokenizer, device_pages: int, host_pages: int) -> KVCache:
    backend = SimBackend(tokenizer, page_size=PAGE, time_scale=0, stand_in=True)
    pool = MemPool(0, backend.spec, host_blocks=host_pages, device_blocks=device_pages)
    backend.attach(pool)
    return KVCache(pool, backend)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def tiers_of(kv: KVCache, tokens: list[int]) -> list[MemType]:
    return [decode(a).mem_type for a in kv.pool.match(tokens).addrs]


def cache_prompt(kv: KVCache, tokens: list[int]) -> None:
    """What a finished request leaves behind: its whole pages, stamped, in the index."""
    seq = Sequence("r", list(tokens), SamplingParams())
    pages = len(tokens) // PAGE
    blocks = kv.alloc(pages)
    assert blocks is not None
    kv.keep(seq, pages, blocks)


def counts(kv: KVCache) -> tuple[int, int]:
    """(blocks in use on both tiers, pages in the index)."""
    used = sum(a.num_used for a in kv.pool.allocators.values())
    return used, kv.pool.index.num_pages


def test_incoming_kv_makes_device_room_by_swapping_out(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=8, host_pages=16)
    old = ids(1, 8 * PAGE)
    cache_prompt(kv, old)
    blocks = kv.alloc_for_peer(4, MemType.DEVICE)
    assert all(decode(b).mem_type is MemType.DEVICE for b in blocks)
    assert kv.tiers.swapped_out_pages == 4 and kv.evicted_blocks == 0
    assert kv.pool.match(old).num_tokens == len(old)  # nothing dropped: the tail is on host
    assert tiers_of(kv, old) == [MemType.DEVICE] * 4 + [MemType.HOST] * 4
    kv.free(blocks)
    assert counts(kv) == (8, 8)


def test_a_load_never_moves_the_requests_own_pages(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=8, host_pages=16)
    mine, other = ids(2, 6 * PAGE), ids(3, 8 * PAGE)
    cache_prompt(kv, mine)
    cache_prompt(kv, other)  # pushes all of `mine` to the host
    assert tiers_of(kv, mine) == [MemType.HOST] * 6
    found = kv.match(mine + [5], len(mine))
    assert kv.host_pages(found) == 6
    assert kv.load(found, then=2) == 6 * PAGE  # room for 6 + 2 came from `other`
    assert all(decode(a).mem_type is MemType.DEVICE for a in found.addrs)
    assert tiers_of(kv, other) == [MemType.HOST] * 8  # the LRU pages that made room
    blocks = kv.alloc(2)
    assert blocks is not None
    seq = Sequence("s", mine + [5] * 20, SamplingParams())
    seq.prefix, seq.cached_tokens = found, len(mine)
    sim = kv.backend
    assert isinstance(sim, SimBackend)
    sim._check_loaded(seq)  # the stamps moved intact with the bytes
    assert sim.verified_pages == 6
    kv.free(blocks)
    kv.release(found)
    assert counts(kv) == (14, 14)


def test_a_load_without_device_room_changes_nothing(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=8, host_pages=16)
    mine = ids(4, 6 * PAGE)
    cache_prompt(kv, mine)
    held = kv.alloc(8)  # running requests hold the whole device: `mine` goes to host
    assert held is not None and tiers_of(kv, mine) == [MemType.HOST] * 6
    found = kv.match(mine, len(mine))
    before = list(found.addrs)
    assert kv.load(found, then=1) is None
    assert found.addrs == before and kv.tiers.swapped_in_pages == 0
    kv.release(found)
    kv.free(held)
    assert counts(kv) == (6, 6)


def test_host_full_drops_its_least_recent_pages_last(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=4, host_pages=4)
    prompts = [ids(10 + i, 4 * PAGE) for i in range(3)]
    for p in prompts:
        cache_prompt(kv, p)
    # 12 pages made: 4 on the device (the newest), 4 on the host, 4 dropped (the oldest).
    assert kv.pool.match(prompts[0]).num_tokens == 0
    assert tiers_of(kv, prompts[1]) == [MemType.HOST] * 4
    assert tiers_of(kv, prompts[2]) == [MemType.DEVICE] * 4
    assert kv.tiers.dropped_host_pages == 4 and kv.tiers.dropped_device_pages == 0
    assert kv.tiers.swapped_out_pages == 8
    assert counts(kv) == (8, 8)


def test_admission_runs_one_chunked_request_first_and_fills_the_rest(
    tokenizer: ChatTokenizer,
) -> None:
    """SGLang's rules: the chunked request takes its chunk first; new requests join only with
    chunk budget left; a long new one takes whole pages of what is left and is chunked next."""
    kv = make_kv(tokenizer, device_pages=64, host_pages=64)
    admission = Admission(kv, 8, 16384, True, chunked_prefill_size=64)
    long_a = Sequence("a", ids(20, 200), SamplingParams())
    short = Sequence("s", ids(21, 20), SamplingParams())
    long_b = Sequence("b", ids(22, 200), SamplingParams())
    waiting = deque([long_a, short, long_b])
    windows = []
    chunked = None
    for _ in range(6):
        step = admission.admit(waiting, [], chunked)
        windows.append([(s.rid, s.extend_from, s.extend_len) for s in step.prefills])
        chunked = step.chunked
    assert windows == [
        [("a", 0, 64)],
        [("a", 64, 64)],
        [("a", 128, 64)],
        [("a", 192, 8), ("s", 0, 20), ("b", 0, 32)],  # 56 left: s whole, b two pages
        [("b", 32, 64)],
        [("b", 96, 64)],
    ]
    assert chunked is long_b and not waiting
    assert len(long_a.blocks) == 13 and len(long_b.blocks) == 10  # pages of chunks so far


def test_a_chunk_budget_below_a_page_is_refused(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=4, host_pages=4)
    with pytest.raises(ValueError, match="below the page size"):
        Admission(kv, 8, 16384, True, chunked_prefill_size=PAGE - 1)


def run_requests(
    tokenizer: ChatTokenizer, kv: KVCache, prompts: list[list[int]], chunk: int | None
) -> list[Sequence]:
    """Submit the prompts together to a running Scheduler and wait for all of them."""
    scheduler = Scheduler(kv.backend, kv, tokenizer, SchedulerConfig(chunked_prefill_size=chunk))

    async def main() -> list[Sequence]:
        await scheduler.start()
        seqs = [
            scheduler.submit(GenerateInput(p, SamplingParams(max_new_tokens=5), False, f"r{i}"))
            for i, p in enumerate(prompts)
        ]
        for seq in seqs:
            while await seq.events.get() != DONE:
                pass
        await scheduler.stop()
        return seqs

    return asyncio.run(main())


def test_scheduler_host_hits_and_chunks_free_what_they_take(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=24, host_pages=48)
    first = ids(30, 150)
    seqs = run_requests(tokenizer, kv, [first, ids(31, 150), ids(32, 150)], chunk=64)
    assert [s.report_cached for s in seqs] == [0, 0, 0]
    again = run_requests(tokenizer, kv, [first + ids(33, 40)], chunk=64)[0]
    assert again.report_cached == 144 and again.host_cached_tokens > 0
    assert again.cached_tokens_details == {
        "device": 144 - again.host_cached_tokens,
        "host": again.host_cached_tokens,
    }
    assert len(again.output_ids) == 5 and again.finish_reason == {"type": "length", "length": 5}
    sim = kv.backend
    assert isinstance(sim, SimBackend) and sim.verified_pages == 9  # its prefix's stamps
    used, indexed = counts(kv)
    assert used == indexed and kv.pool.index.protected_pages == 0


def write_back(kv: KVCache, tokens: list[int]) -> int:
    """What a decode's write-back does here: the receiver inserts the pages this instance
    lacks into its index, then the engine learns them; returns the pages that were new."""
    cached = kv.pool.match(tokens).num_tokens // PAGE
    pages = len(tokens) // PAGE
    blocks = kv.alloc(pages - cached)
    assert blocks is not None
    kv.pool.insert(tokens, kv.lookup(tokens[: cached * PAGE]) + blocks)
    kv.note_inserted(tokens, cached, pages - cached, written_back=True)
    return pages - cached


def written_back_hit(kv: KVCache, tokens: list[int]) -> int:
    found = kv.match(tokens + [7], len(tokens))
    try:
        return kv.written_back_tokens(found)
    finally:
        kv.release(found)


def test_written_back_pages_count_apart_until_dropped(tokenizer: ChatTokenizer) -> None:
    kv = make_kv(tokenizer, device_pages=8, host_pages=8)
    prompt = ids(4, 3 * PAGE)
    turn = prompt + ids(5, 2 * PAGE)  # the prompt and the answer the decode wrote back
    cache_prompt(kv, prompt)  # the prefill cached its own prompt
    assert written_back_hit(kv, prompt) == 0
    assert write_back(kv, turn) == 2  # only the answer's pages were new here
    assert written_back_hit(kv, turn) == 2 * PAGE
    cache_prompt(kv, ids(6, 8 * PAGE))  # the device fills: the turn moves to the host tier
    assert set(tiers_of(kv, turn)) == {MemType.HOST}
    assert written_back_hit(kv, turn) == 2 * PAGE  # still written back, wherever it is
    cache_prompt(kv, ids(7, 8 * PAGE))  # and out: the host drops it
    assert kv.pool.match(turn).num_tokens == 0
    cache_prompt(kv, turn)  # this instance computes the turn itself
    assert written_back_hit(kv, turn) == 0
