"""Retraction under KV pressure, in one process: the Scheduler on a real MemPool too small for
its running requests, with the sim backend's stamped stand-in pages (every reused page's bytes
are checked) and with the real tiny model (greedy output of a retracted request equals the
output of the same request run alone)."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest

from connector.worker.admission import Admission, TokenRatio
from connector.worker.backend import Backend
from connector.worker.backend_sim import SimBackend
from connector.worker.kv_cache import KVCache
from connector.worker.protocol import GenerateInput
from connector.worker.scheduler import Scheduler, SchedulerConfig
from connector.worker.sequence import DONE, SamplingParams, Sequence
from mempool import InsertFlags, MemPool
from shared.tokenizer import ChatTokenizer

PAGE = 16


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def sim_kv(tokenizer: ChatTokenizer, pages: int, host_pages: int = 0) -> KVCache:
    backend = SimBackend(tokenizer, page_size=PAGE, time_scale=0, stand_in=True)
    if host_pages:
        pool = MemPool(0, backend.spec, host_blocks=host_pages, device_blocks=pages)
    else:
        pool = MemPool(0, backend.spec, host_blocks=pages)
    backend.attach(pool)
    return KVCache(pool, backend)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def gen(prompt: list[int], max_new: int, rid: str) -> GenerateInput:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return GenerateInput(prompt, params, False, rid)


def run(
    scheduler: Scheduler, requests: list[GenerateInput], stagger_s: float = 0.0
) -> list[Sequence]:
    """Submit the requests (`stagger_s` apart) to a running scheduler, wait for all."""

    async def main() -> list[Sequence]:
        await scheduler.start()
        seqs = []
        for request in requests:
            seqs.append(scheduler.submit(request))
            await asyncio.sleep(stagger_s)
        for seq in seqs:
            while await seq.events.get() != DONE:
                pass
        await scheduler.stop()
        return seqs

    return asyncio.run(main())


def balanced(kv: KVCache) -> None:
    """Nothing leaked: every used block is in the index, nothing is pinned."""
    used = sum(a.num_used for a in kv.pool.allocators.values())
    assert used == kv.pool.index.num_pages * kv.bpp
    assert kv.pool.index.protected_pages == 0


def scheduler_for(kv: KVCache, tokenizer: ChatTokenizer, **config: object) -> Scheduler:
    return Scheduler(kv.backend, kv, tokenizer, SchedulerConfig(**config))  # type: ignore[arg-type]


def test_decodes_that_outgrow_memory_are_retracted_and_finish_whole(
    tokenizer: ChatTokenizer,
) -> None:
    """Four requests admitted together (a ratio of 0 reserves nothing for their growth) need
    4 x (3 + 4) pages; 16 pages hold them only if some give way and come back."""
    kv = sim_kv(tokenizer, pages=16)
    scheduler = scheduler_for(kv, tokenizer, ratio=TokenRatio(0.0, 0.0, 0.0))
    prompts = [ids(i, 3 * PAGE - 4) for i in range(4)]
    seqs = run(scheduler, [gen(p, 64, f"r{i}") for i, p in enumerate(prompts)])
    assert scheduler.stats.retracted > 0 and scheduler.stats.aborted == 0
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.finish_reason == {"type": "length", "length": 64}
        assert len(seq.output_ids) == 64
        alone = run(scheduler_for(sim_kv(tokenizer, 64), tokenizer), [gen(prompt, 64, "a")])[0]
        assert seq.output_ids == alone.output_ids
    retracted = [s for s in seqs if s.retractions]
    assert retracted and all(s.reported_cached == 0 for s in retracted)  # first admission's
    assert scheduler.stats.retracted_output_tokens > 0
    assert scheduler.stats.requests == 4  # a resumed request is not counted twice
    balanced(kv)


def test_the_request_that_loses_least_is_retracted_first(tokenizer: ChatTokenizer) -> None:
    """SGLang's order: fewest generated tokens first (the latest arrival here)."""
    kv = sim_kv(tokenizer, pages=12)
    scheduler = scheduler_for(kv, tokenizer, ratio=TokenRatio(0.0, 0.0, 0.0))
    requests = [gen(ids(10 + i, 2 * PAGE), 48, f"r{i}") for i in range(3)]
    order: list[str] = []
    original = scheduler._retract

    def spy(seq: Sequence) -> None:
        order.append(f"{seq.rid}:{len(seq.output_ids)}")
        original(seq)

    scheduler._retract = spy  # type: ignore[method-assign]
    seqs = run(scheduler, requests)  # one step apart
    assert order, "memory never ran short"
    first, outputs = order[0].split(":")
    counts = {s.rid: s for s in seqs}
    assert first == "r2"  # the latest arrival had generated the fewest tokens
    assert all(len(s.output_ids) == 48 for s in counts.values())
    assert int(outputs) >= 1
    balanced(kv)


def test_the_ratio_rises_on_retraction_decays_and_resets(tokenizer: ChatTokenizer) -> None:
    ratio = TokenRatio(0.5, 0.1, 0.1)
    ratio.step()
    ratio.step()
    assert ratio.current == pytest.approx(0.3)
    for _ in range(10):
        ratio.step()
    assert ratio.current == pytest.approx(0.1)
    running = [Sequence("a", [1] * 10, SamplingParams(max_new_tokens=100)) for _ in range(2)]
    for seq in running:
        seq.output_ids = [5] * 30
    ratio.after_retract(running)
    assert ratio.current == pytest.approx((60 + 40) / 201)
    ratio.reset()
    assert ratio.current == 0.5
    with pytest.raises(ValueError, match="min"):
        TokenRatio(0.2, 0.5, 0.01)
    with pytest.raises(ValueError, match="init"):
        TokenRatio(1.5, 0.1, 0.01)


def test_admission_keeps_memory_for_what_running_requests_will_generate(
    tokenizer: ChatTokenizer,
) -> None:
    kv = sim_kv(tokenizer, pages=20)
    admission = Admission(kv, 8, 16384, True, ratio=TokenRatio(1.0, 1.0, 0.0))
    running = Sequence("run", ids(1, PAGE), SamplingParams(max_new_tokens=8 * PAGE))
    running.blocks = kv.alloc(2) or []
    newcomer = Sequence("new", ids(2, 4 * PAGE), SamplingParams(max_new_tokens=4 * PAGE))
    waiting = deque([newcomer])
    # 18 free pages, 8 of them reserved for the running request's output: 10 left, and the
    # newcomer needs 4 + 4.
    assert admission.admit(waiting, [running], None).new == [newcomer]
    kv.free(newcomer.blocks)
    newcomer.blocks = []
    big = Sequence("big", ids(3, 6 * PAGE), SamplingParams(max_new_tokens=6 * PAGE))
    waiting = deque([big])
    assert admission.admit(waiting, [running], None).new == []  # 6 + 6 > 10: it waits
    assert list(waiting) == [big] and kv.pool.index.protected_pages == 0
    admission.ratio = TokenRatio(0.25, 0.25, 0.0)  # expect a quarter: 2 reserved, 16 left
    assert admission.admit(waiting, [running], None).new == [big]
    # Nothing running: a request whose output may not fit still starts (retraction is there).
    kv.free(big.blocks + running.blocks)
    alone = Sequence("alone", ids(4, 4 * PAGE), SamplingParams(max_new_tokens=100 * PAGE))
    assert admission.admit(deque([alone]), [], None).new == [alone]


def test_a_request_that_cannot_fit_alone_is_aborted_with_what_it_needs(
    tokenizer: ChatTokenizer,
) -> None:
    kv = sim_kv(tokenizer, pages=6)
    scheduler = scheduler_for(kv, tokenizer)
    long_one, short = gen(ids(5, 4 * PAGE), 5 * PAGE, "long"), gen(ids(6, PAGE), 4, "short")
    seqs = run(scheduler, [long_one, short])
    reason = seqs[0].finish_reason or {}
    assert reason.get("type") == "abort"
    assert "needs 112 tokens of KV" in reason["message"]
    assert "holds 96" in reason["message"]
    assert len(seqs[0].output_ids) >= 2 * PAGE - 1  # it ran until memory ended
    assert seqs[1].finish_reason == {"type": "length", "length": 4}
    assert scheduler.stats.aborted == 1
    balanced(kv)


def test_the_last_request_waits_for_pages_a_transfer_pinned_and_finishes_whole(
    tokenizer: ChatTokenizer,
) -> None:
    """A PD decode's memory pinned by KV in flight (a push, a write-back, a peer's pull) is
    only lent: the one request left that cannot grow is retracted to wait for it, never
    aborted, and its answer is the one it gives alone."""
    kv = sim_kv(tokenizer, pages=6)
    scheduler = scheduler_for(kv, tokenizer, ratio=TokenRatio(0.0, 0.0, 0.0))
    blocks = kv.alloc(3 * kv.bpp) or []
    in_flight = kv.pool.insert(ids(40, 3 * PAGE), blocks, InsertFlags.LOCK)
    prompt = ids(41, PAGE)  # 4 pages by its end, 3 free while the transfer holds 3

    async def main() -> Sequence:
        await scheduler.start()
        seq = scheduler.submit(gen(prompt, 3 * PAGE, "r"))
        for _ in range(1000):
            if scheduler.stats.retracted or seq.finish_reason is not None:
                break
            await asyncio.sleep(0.01)
        assert seq.finish_reason is None and scheduler.stats.retracted > 0
        await asyncio.sleep(0.05)  # it waits, rather than ends, while the pages stay pinned
        assert seq.finish_reason is None and seq in scheduler.waiting
        kv.release(in_flight)
        while await seq.events.get() != DONE:
            pass
        await scheduler.stop()
        return seq

    seq = asyncio.run(main())
    assert seq.finish_reason == {"type": "length", "length": 3 * PAGE}
    alone = run(scheduler_for(sim_kv(tokenizer, 64), tokenizer), [gen(prompt, 3 * PAGE, "a")])
    assert seq.output_ids == alone[0].output_ids
    assert scheduler.stats.aborted == 0
    balanced(kv)


def test_retraction_with_chunked_prefill_and_a_host_tier(tokenizer: ChatTokenizer) -> None:
    """Retracted pages go to the host tier rather than vanish, and come back as host hits;
    a long prompt prefilled in chunks meanwhile is not disturbed."""
    kv = sim_kv(tokenizer, pages=24, host_pages=64)
    scheduler = scheduler_for(kv, tokenizer, chunked_prefill_size=64, ratio=TokenRatio(0, 0, 0))
    requests = [gen(ids(20 + i, 3 * PAGE), 80, f"d{i}") for i in range(3)]
    requests.append(gen(ids(30, 6 * PAGE), 80, "long"))
    seqs = run(scheduler, requests)
    assert scheduler.stats.retracted > 0 and scheduler.stats.aborted == 0
    assert all(s.finish_reason and s.finish_reason["type"] == "length" for s in seqs)
    assert kv.tiers.swapped_out_pages > 0 and kv.tiers.swapped_in_pages > 0
    sim = kv.backend
    assert isinstance(sim, SimBackend) and sim.verified_pages > 0
    balanced(kv)


def test_state_reports_ratio_retractions_and_queue(tokenizer: ChatTokenizer) -> None:
    kv = sim_kv(tokenizer, pages=16)
    scheduler = scheduler_for(kv, tokenizer, ratio=TokenRatio(0.0, 0.0, 0.0))
    run(scheduler, [gen(ids(40 + i, 3 * PAGE - 4), 64, f"r{i}") for i in range(4)])
    state = scheduler.state()
    assert state["num_retracted_reqs"] == scheduler.stats.retracted > 0
    assert state["num_retracted_output_tokens"] > 0
    assert state["num_queue_reqs"] == 0 and state["num_queue_tokens"] == 0
    assert 0.0 <= state["new_token_ratio"] <= 1.0


# ------------------------------------------------------------------ the real tiny model


@pytest.fixture(scope="module")
def hf_backend(model_dir: Path) -> Backend:
    from connector.worker.backend_hf import HFBackend

    return HFBackend(model_dir, page_size=PAGE)


def hf_kv(backend: Backend, pages: int) -> KVCache:
    pool = MemPool(0, backend.spec, host_blocks=pages)
    backend.attach(pool)
    return KVCache(pool, backend)


def chat_ids(tokenizer: ChatTokenizer, question: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": question}])


@pytest.mark.parametrize("cache", [True, False], ids=["radix-cache", "no-cache"])
def test_hf_greedy_output_after_retraction_equals_the_request_alone(
    hf_backend: Backend, tokenizer: ChatTokenizer, cache: bool
) -> None:
    questions = [
        "Why is the sky blue? Explain it to a child.",
        "Name three rivers in Europe and say where each one flows.",
        "How do bees make honey? Give the steps.",
    ]
    prompts = [chat_ids(tokenizer, q) for q in questions]
    requests = [
        GenerateInput(p, SamplingParams(max_new_tokens=40, temperature=0.0), False, f"q{i}")
        for i, p in enumerate(prompts)
    ]
    alone = []
    for request in requests:
        kv = hf_kv(hf_backend, 64)
        alone.append(run(scheduler_for(kv, tokenizer, enable_cache=cache), [request])[0])
        kv.pool.close()
    pages = [-(-(len(p) + 40) // PAGE) for p in prompts]
    # well short of all three at once (they share the chat template's first pages), room
    # for each alone
    kv = hf_kv(hf_backend, max(max(pages) + 1, sum(pages) - 8))
    scheduler = scheduler_for(kv, tokenizer, enable_cache=cache, ratio=TokenRatio(0, 0, 0))
    together = run(scheduler, requests)
    assert scheduler.stats.retracted > 0 and scheduler.stats.aborted == 0
    for got, want in zip(together, alone, strict=True):
        assert got.output_ids == want.output_ids
        assert got.finish_reason == want.finish_reason
    if cache:
        balanced(kv)
    kv.pool.close()


def test_a_prompt_is_cached_once_prefilled_not_when_its_request_ends(
    tokenizer: ChatTokenizer,
) -> None:
    """SGLang inserts a prompt into its radix cache after prefill: a request sharing it that
    arrives while the first one still decodes reuses it."""
    kv = sim_kv(tokenizer, pages=64)
    scheduler = scheduler_for(kv, tokenizer)
    shared = ids(50, 10 * PAGE)

    async def main() -> tuple[Sequence, Sequence]:
        await scheduler.start()
        first = scheduler.submit(gen([*shared, *ids(51, 8)], 40, "first"))
        assert await first.events.get() != DONE  # its first token: prefilled
        second = scheduler.submit(gen([*shared, *ids(52, 8)], 4, "second"))
        for seq in (second, first):
            while await seq.events.get() != DONE:
                pass
        await scheduler.stop()
        return first, second

    first, second = asyncio.run(main())
    assert first.finish_reason == {"type": "length", "length": 40}
    assert second.report_cached == len(shared)  # the first one was still decoding
    assert first.report_cached == 0  # what its own admission found
    sim = kv.backend
    assert isinstance(sim, SimBackend) and sim.verified_pages >= 10
    balanced(kv)
