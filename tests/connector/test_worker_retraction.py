"""Retraction over HTTP, in real sim workers whose KV memory is far smaller than their
concurrent requests need: nothing ends "out of KV cache memory", every answer is whole and
equals the answer of a worker with memory to spare, and a PD decode instance that retracts a
request it received by transfer keeps its KV in its host tier (or, without caching, recomputes
it itself) and finishes it. The sim backend checks the stamp of every page of KV it reuses, so
a resumed request built on wrong KV fails rather than passes."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.http_client import call, metric
from tests.procs import ROOT, Server, free_port, running

PAGE = 16
# A low new-token ratio admits more than fits, which forces retraction.
LOW_RATIO = ["--init-new-token-ratio", "0.05", "--min-new-token-ratio", "0.05"]


def sim(model_dir: Path, *extra: str) -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "1", *extra]


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(length)] for _ in range(count)]


def generate(url: str, ids: list[int], max_new: int, extra: dict[str, Any] | None = None) -> Any:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}, **(extra or {})}
    status, answer = call(url + "/generate", body)
    assert status == 200, answer
    return answer


def state(worker: Server) -> dict[str, Any]:
    status, info = call(worker.url + "/get_server_info")
    assert status == 200, info
    return info


def no_leak(worker: Server) -> None:
    info = state(worker)
    pool = info["mempool"]
    used = sum(t["used"] for t in pool["tiers"].values())
    assert used == pool["cached_tokens"] // PAGE, (used, pool["cached_tokens"])
    assert pool["protected_pages"] == 0


@pytest.fixture(scope="module")
def roomy(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A worker with memory to spare: the reference answers."""
    with running("connector.worker", sim(model_dir), tmp_path_factory.mktemp("roomy")) as w:
        yield w


def test_a_colocated_worker_retracts_instead_of_aborting(
    model_dir: Path, tmp_path: Path, roomy: Server
) -> None:
    batch = prompts(1, 8, 100)
    args = sim(model_dir, "--max-total-tokens", "512", *LOW_RATIO)
    with running("connector.worker", args, tmp_path) as worker, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ids: generate(worker.url, ids, 96), batch))
        for ids, answer in zip(batch, answers, strict=True):
            finish = answer["meta_info"]["finish_reason"]
            assert finish["type"] == "length", finish
            assert answer["output_ids"] == generate(roomy.url, ids, 96)["output_ids"]
        internal = state(worker)["internal_states"][0]
        assert internal["num_retracted_reqs"] > 0
        assert internal["num_retracted_output_tokens"] > 0
        assert internal["num_queue_reqs"] == 0 and 0 < internal["new_token_ratio"] <= 1
        status, metrics = call(worker.url + "/metrics")
        assert status == 200
        retracted = metric(metrics, "sglang:num_retracted_requests_total")
        assert retracted == internal["num_retracted_reqs"]
        assert metric(metrics, "sglang:num_aborted_requests_total") == 0
        no_leak(worker)


def test_a_worker_refuses_a_flag_ratio_out_of_range(model_dir: Path, tmp_path: Path) -> None:
    args = sim(model_dir, "--init-new-token-ratio", "0.1", "--min-new-token-ratio", "0.5")
    done = subprocess.run(
        [sys.executable, "-m", "connector.worker", "--port", str(free_port()), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--min-new-token-ratio" in done.stderr and "above the initial" in done.stderr


@pytest.mark.parametrize(
    ("caching", "decode_extra"),
    [
        ("caching-3", ["--enable-hierarchical-cache", "--hicache-ratio", "4"]),
        ("basic", []),
    ],
    ids=["caching-3-host-tier", "basic-recompute"],
)
def test_a_pd_decode_retracts_what_it_received_and_finishes_it(
    model_dir: Path, tmp_path: Path, roomy: Server, caching: str, decode_extra: list[str]
) -> None:
    boot = free_port()
    common = ["--pd-caching", caching, "--disaggregation-timeout-secs", "60"]
    prefill = sim(
        model_dir, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)
    )
    decode = sim(
        model_dir,
        "--disaggregation-mode",
        "decode",
        "--max-total-tokens",
        "768",
        *LOW_RATIO,
        *decode_extra,
    )
    batch = prompts(2, 6, 120)
    with (
        running("connector.worker", [*prefill, *common], tmp_path) as p,
        running("connector.worker", [*decode, *common], tmp_path) as d,
        ThreadPoolExecutor(12) as pool,
    ):

        def pd(ids: list[int]) -> Any:
            room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot}
            room["bootstrap_room"] = random.randrange(2**63)
            to_prefill = pool.submit(generate, p.url, ids, 96, room)
            answer = generate(d.url, ids, 96, room)
            to_prefill.result()
            return answer

        answers = list(pool.map(pd, batch))
        for ids, answer in zip(batch, answers, strict=True):
            finish = answer["meta_info"]["finish_reason"]
            assert finish["type"] == "length", finish
            assert answer["output_ids"] == generate(roomy.url, ids, 96)["output_ids"]
        info = state(d)
        assert info["internal_states"][0]["num_retracted_reqs"] > 0
        assert info["backend"]["verified_pages"] > 0  # reused KV checked page by page
        if caching == "caching-3":  # the retracted KV went to DRAM and came back from there
            host = info["kv_tiers"]["host"]
            assert host["swapped_out_tokens"] > 0 and host["swapped_in_tokens"] > 0
        for worker in (p, d):
            no_leak(worker)


def test_requests_that_pulled_their_prefix_are_retracted_and_finish(
    model_dir: Path, tmp_path: Path, roomy: Server
) -> None:
    """A shared prefix pulled from a peer (MemPool pull), then memory too small for all the
    requests that reuse it: they retract, resume from the pulled pages still cached, and
    neither worker keeps a block or a pin."""
    secret = ["--enable-mempool-pull", "--mempool-secret", "retraction-test"]
    shared = prompts(3, 1, 160)[0]
    tails = prompts(4, 6, 20)
    with (
        running("connector.worker", sim(model_dir, *secret), tmp_path) as holder,
        running(
            "connector.worker",
            sim(model_dir, *secret, "--max-total-tokens", "512", *LOW_RATIO),
            tmp_path,
        ) as puller,
        ThreadPoolExecutor(6) as pool,
    ):
        generate(holder.url, shared, 1)
        agent = state(holder)["memserve"]["agent"]
        hint = {
            "memserve": {"prefix_holders": [{"url": holder.url, "cached_tokens": 160, **agent}]}
        }
        batch = [shared + tail for tail in tails]
        answers = list(pool.map(lambda ids: generate(puller.url, ids, 96, hint), batch))
        for ids, answer in zip(batch, answers, strict=True):
            finish = answer["meta_info"]["finish_reason"]
            assert finish["type"] == "length", finish
            assert answer["output_ids"] == generate(roomy.url, ids, 96)["output_ids"]
        info = state(puller)
        assert info["pull"]["pulls"] >= 1 and info["pull"]["pulled_tokens"] >= 160
        assert info["internal_states"][0]["num_retracted_reqs"] > 0
        for worker in (holder, puller):
            no_leak(worker)
