"""A salt group's share of the worker's KV cache (`--max-cached-tokens-per-salt`, issue 38):
a tenant sending a fresh `cache_salt` on every request (`<tenant salt>:<random>`) loses its
own oldest cached paths over its share, and another tenant's cache stays. Real sim workers
over HTTP; the same flood without the bound evicts the other tenant's prefixes (the test
can fail)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connector.test_worker_sim import generate, prompt_ids, sim_args
from tests.procs import Server, run_module, running

KV_TOKENS = 4096
SHARE_TOKENS = 1024  # A's eight 7-page documents fit; B's flood is held to it


@pytest.fixture(scope="module")
def workers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """A worker with the per-salt bound, one without: KV for about 36 documents each."""
    tmp = tmp_path_factory.mktemp("salt-shares")
    base = sim_args(model_dir, "--max-total-tokens", str(KV_TOKENS))
    capped = [*base, "--max-cached-tokens-per-salt", str(SHARE_TOKENS)]
    with (
        running("connector.worker", capped, tmp) as w0,
        running("connector.worker", base, tmp) as w1,
    ):
        yield [w0, w1]


def a_hit_ratio_after_a_flood(worker: Server, seed: int) -> float:
    """A (salt 'tenant-a') caches eight documents; B sends 60 prompts, each under a fresh
    salt of its tenant's ('tenant-b:<n>'); then A's documents again: their hit ratio."""
    docs = [prompt_ids(seed * 100 + i, 112) for i in range(8)]
    for doc in docs:
        generate(worker, doc, max_new=1, cache_salt="tenant-a")
    for i in range(60):
        generate(worker, prompt_ids(seed * 1000 + i, 112), 1, cache_salt=f"tenant-b:{seed}-{i}")
    prompt = cached = 0
    for doc in docs:
        meta = generate(worker, doc, max_new=1, cache_salt="tenant-a")["meta_info"]
        prompt += meta["prompt_tokens"]
        cached += meta["cached_tokens"]
    return cached / prompt


def test_a_fresh_salt_flood_keeps_to_its_share_of_the_kv_cache(workers: list[Server]) -> None:
    capped, uncapped = workers
    assert a_hit_ratio_after_a_flood(capped, 1) == 96 / 112  # as unflooded: 6 of 7 pages
    assert a_hit_ratio_after_a_flood(uncapped, 2) == 0.0  # the flood evicted A's cache


def test_a_negative_share_is_a_startup_error() -> None:
    run = run_module("connector.worker", ["--max-cached-tokens-per-salt", "-1"])
    assert run.returncode != 0
    assert "--max-cached-tokens-per-salt must be a number of tokens >= 0" in run.stderr
    assert "Traceback" not in run.stderr
