"""Failure paths the reliability benchmark found or was asked to check in the worker: text no
tokenizer takes, a cache flush while KV is pinned by a transfer, a PD hand-off that fails
after its pages were cached and pinned. Each must end in a clear 4xx or a clean free."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from connector.worker.backend_sim import SimBackend
from connector.worker.kv_cache import KVCache
from connector.worker.pd import PDConfig, PDLink, PDMode
from connector.worker.pd_hooks import PDHooks
from connector.worker.sequence import DONE, SamplingParams, Sequence
from mempool import InsertResult, MemPool
from shared.tokenizer import ChatTokenizer
from tests.connector.test_worker_sim_pd import info, pd_pair, prompt_ids, used_pages, with_room
from tests.http_client import call
from tests.procs import running

PAGE = 16


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", b'{"text": "a\\ud800"}'),
        ("/v1/completions", b'{"prompt": "\\udc80"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_500(
    model_dir: Path, tmp_path: Path, route: str, body: bytes
) -> None:
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    with running("connector.worker", args, tmp_path) as worker:
        status, answer = call(worker.url + route, raw=body)
        assert status == 400 and "tokenize" in answer["message"], answer
        assert call(worker.url + "/health")[0] == 200


def test_flush_during_a_write_back_is_a_busy_400_then_works(
    model_dir: Path, tmp_path: Path
) -> None:
    # A 0.1 Gb/s modelled link: the decode's PD-Caching-3 write-back of ~20 pages stays
    # pinned on the wire for seconds after the client has its answer.
    slow = ("--sim-interconnect-gbps", "0.1")
    with pd_pair(model_dir, tmp_path, "caching-3", *slow, time_scale="1") as (p, d, boot):
        body = with_room({"input_ids": prompt_ids(3, 300), "sampling_params": {}}, boot)
        body["sampling_params"] = {"max_new_tokens": 40}
        with ThreadPoolExecutor(2) as pool:
            pre = pool.submit(call, p.url + "/generate", body)
            status, _ = call(d.url + "/generate", body)
            assert status == 200 and pre.result()[0] == 200
        assert info(d)["mempool"]["protected_pages"] > 0  # the write-back is on the wire
        status, answer = call(d.url + "/flush_cache", method="POST", raw=b"")
        assert status == 400 and "busy" in answer["message"], answer
        deadline = time.monotonic() + 20
        while info(d)["disaggregation"]["written_back"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert call(d.url + "/flush_cache", method="POST", raw=b"")[0] == 200
        assert used_pages(d) == (0, 0)


class Engine:
    """The scheduler's side of a hand-off, as the Engine protocol asks (retire as it does)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.retired: list[list[int]] = []

    def enqueue(self, seq: Sequence) -> None:
        raise AssertionError("not used by a prefill hand-off")

    def join_prefilled(self, seq: Sequence) -> None:
        raise AssertionError("not used by a prefill hand-off")

    def retire(self, seq: Sequence, free: list[int], pinned: InsertResult | None = None) -> None:
        self.retired.append(list(free))
        self.kv.free(free)
        seq.blocks = []
        if seq.prefix is not None:
            self.kv.release(seq.prefix)
            seq.prefix = None
        if pinned is not None:
            self.kv.release(pinned)
        seq.events.put_nowait(DONE)


def test_a_hand_off_failing_after_pinning_frees_and_unpins(model_dir: Path) -> None:
    """The prefill cached and pinned the prompt's whole pages, then writing its partial last
    page failed: the whole pages stay cache, unpinned; only the partial page's block is
    freed (freeing the cached ones too was refused and kept the pin for good)."""

    async def scenario() -> None:
        backend = SimBackend(ChatTokenizer(model_dir), page_size=PAGE, time_scale=0, stand_in=True)
        pool = MemPool(0, backend.spec, host_blocks=64)
        backend.attach(pool)
        kv = KVCache(pool, backend)
        hooks = PDHooks(PDLink(PDConfig(mode=PDMode.PREFILL), pool))
        engine = Engine(kv)
        rng = random.Random(5)
        seq = Sequence("r1", [rng.randrange(200, 40000) for _ in range(40)], SamplingParams())
        blocks = kv.alloc(3)
        assert blocks is not None
        seq.blocks, seq.prefilled, seq.room = blocks, True, 77
        seq.output_ids.append(11)

        write = kv.write

        def broken_write(seq: Sequence, first: int, blocks: list[int], partial: bool) -> None:
            if partial:  # the partial last page, written after the whole pages were pinned
                raise OSError("the device went away")
            write(seq, first, blocks, partial)

        kv.write = broken_write  # type: ignore[method-assign,assignment]
        assert hooks.on_finish(seq, cache=True, engine=engine)
        assert seq.handoff_error is not None and "device went away" in seq.handoff_error
        assert engine.retired == [blocks[2:]]  # the partial page's block only
        stats = pool.stats()
        assert stats["protected_pages"] == 0
        assert stats["tiers"]["host"]["used"] == stats["cached_tokens"] // PAGE == 2

    asyncio.run(scenario())
