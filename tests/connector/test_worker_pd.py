"""Prefill/decode disaggregation between real hf workers: exact output, caching modes, faults.

Each request goes to a prefill and a decode worker at once with SGLang's bootstrap fields,
as a router sends it; KV moves through MemPool transfer agents over loopback TCP.
"""

from __future__ import annotations

import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.http_client import call
from tests.procs import free_port, running

PAGE = 16
PROMPT = 75  # not page-aligned; with 8 new tokens the KV crosses a page boundary


def hf_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--backend", "hf", "--model-path", str(model_dir), "--threads", "1", *extra]


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


@contextlib.contextmanager
def pd_pair(model_dir: Path, log_dir: Path, caching: str, timeout: str = "20"):
    boot = free_port()
    common = ["--pd-caching", caching, "--disaggregation-timeout-secs", timeout]
    prefill = hf_args(
        model_dir,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(boot),
        "--instance-id",
        "11",
        *common,
    )
    decode = hf_args(model_dir, "--disaggregation-mode", "decode", "--instance-id", "12", *common)
    with (
        running("connector.worker", prefill, log_dir) as p,
        running("connector.worker", decode, log_dir) as d,
    ):
        yield p, d, boot


def pd_generate(p, d, boot: int, ids: list[int], max_new: int = 8) -> tuple[dict, dict]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": boot,
        "bootstrap_room": random.randrange(2**63),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(call, w.url + "/generate", body) for w in (p, d)]
        (ps, pb), (ds, db) = (f.result() for f in futures)
    assert ps == 200, pb
    assert ds == 200, db
    return pb, db


def wait_written_back(decode, count: int, timeout: float = 20) -> None:
    """The write-back runs after the decode answered: wait for it like a next turn would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, info = call(decode.url + "/get_server_info")
        if info["disaggregation"]["written_back"] >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no write-back #{count} within {timeout} s: {info['disaggregation']}")


def no_leak(worker) -> dict:
    """Every allocated block is indexed cache: nothing a request held is left over."""
    status, info = call(worker.url + "/get_server_info")
    assert status == 200
    pool = info["mempool"]
    used = sum(t["used"] for t in pool["tiers"].values())
    assert used * PAGE == pool["cached_tokens"], pool
    return info


@pytest.fixture(scope="module")
def colocated(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running(
        "connector.worker", hf_args(model_dir), tmp_path_factory.mktemp("colocated")
    ) as server:
        yield server


def colocated_output(worker, ids: list[int], max_new: int = 8) -> list[int]:
    status, body = call(
        worker.url + "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}},
    )
    assert status == 200, body
    return body["output_ids"]


# prefill's cached_tokens on turn 2, as a function of turn 1's prompt and output lengths
EXPECTED_TURN2_CACHED = {
    "basic": lambda prompt, out: 0,
    "caching-1": lambda prompt, out: prompt // PAGE * PAGE,
    "caching-2": lambda prompt, out: prompt // PAGE * PAGE,
    "caching-3": lambda prompt, out: (prompt + out - 1) // PAGE * PAGE,
}


@pytest.mark.parametrize("caching", ["basic", "caching-1", "caching-2", "caching-3"])
def test_pd_output_equals_colocated_in_every_caching_mode(
    model_dir: Path, tmp_path: Path, colocated, caching: str
) -> None:
    turn1 = prompt_ids(1, PROMPT)
    with pd_pair(model_dir, tmp_path, caching) as (p, d, boot):
        pre1, dec1 = pd_generate(p, d, boot, turn1)
        out1 = dec1["output_ids"]
        assert out1 == colocated_output(colocated, turn1)
        assert pre1["meta_info"]["cached_tokens"] == 0 == dec1["meta_info"]["cached_tokens"]

        if caching == "caching-3":
            wait_written_back(d, 1)
        turn2 = turn1 + out1 + prompt_ids(2, 20)
        pre2, dec2 = pd_generate(p, d, boot, turn2)
        assert dec2["output_ids"] == colocated_output(colocated, turn2)
        expected = EXPECTED_TURN2_CACHED[caching](len(turn1), len(out1))
        assert pre2["meta_info"]["cached_tokens"] == expected
        assert dec2["meta_info"]["cached_tokens"] == expected  # the client sees the skip

        _, info = call(p.url + "/get_server_info")
        assert info["disaggregation"]["sent"] == 2
        # turn 2 decoded no page the prefill lacks (it caches its prompts): nothing to send
        no_leak(p)
        no_leak(d)


def test_prefill_without_a_decode_claim_fails_clearly_and_frees(
    model_dir: Path, tmp_path: Path
) -> None:
    with pd_pair(model_dir, tmp_path, "caching-3", timeout="1.5") as (p, d, boot):
        body = {
            "input_ids": prompt_ids(3, 40),
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": 12345,
        }
        status, answer = call(p.url + "/generate", body)
        assert status == 502
        assert "no decode instance claimed bootstrap_room 12345" in answer["message"]
        no_leak(p)

        dead = dict(body, bootstrap_port=free_port(), bootstrap_room=7)
        status, answer = call(d.url + "/generate", dead)
        assert status == 502 and "cannot reach the prefill bootstrap server" in answer["message"]
        status, answer = call(d.url + "/generate", dict(dead, stream=True))  # no stream begins
        assert status == 502 and "cannot reach the prefill bootstrap server" in answer["message"]
        no_leak(d)

        status, answer = call(d.url + "/generate", dict(body, bootstrap_room="x"))
        assert status == 400 and "bootstrap_room" in answer["message"]
        # without bootstrap fields either side serves the request alone
        assert call(d.url + "/generate", {"input_ids": prompt_ids(4, 20)})[0] == 200
