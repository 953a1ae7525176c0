"""Pulls of a remote prefix between real tiny-model workers: the real KV bytes move, and the
greedy output after a pull is token for token the output computed from scratch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connector.test_worker_pull_sim import (
    PAGE,
    SECRET,
    hint,
    info,
    no_leak,
    prompt_ids,
    pull_stats,
)
from tests.http_client import call
from tests.procs import Server, running


def hf_args(model_dir: Path) -> list[str]:
    return [
        "--backend",
        "hf",
        "--model-path",
        str(model_dir),
        "--threads",
        "1",
        "--max-total-tokens",
        "4096",
        "--enable-mempool-pull",
        "--mempool-secret",
        SECRET,
    ]


def greedy(worker: Server, ids: list[int], max_new: int = 16, **extra: Any) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
        **extra,
    }
    status, answer = call(worker.url + "/generate", body, timeout=120)
    assert status == 200, answer
    return answer


@pytest.fixture(scope="module")
def hf_pair(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("pull-hf")
    with (
        running("connector.worker", hf_args(model_dir), logs, timeout=180) as holder,
        running("connector.worker", hf_args(model_dir), logs, timeout=180) as puller,
    ):
        yield holder, puller


def test_greedy_output_after_a_pull_equals_the_output_from_scratch(
    hf_pair: tuple[Server, Server],
) -> None:
    holder, puller = hf_pair
    ids = prompt_ids(1, 300)
    warm = greedy(holder, ids, max_new=8)
    held = (len(ids) + len(warm["output_ids"]) - 1) // PAGE * PAGE
    assert held >= len(ids) // PAGE * PAGE  # the holder caches its output's KV too

    # The holder's answer continues the prompt; the puller gets that history plus a new turn.
    asked = ids + warm["output_ids"][:-1] + prompt_ids(2, 40)
    pulled = greedy(puller, asked, memserve=hint(holder, held))
    assert pulled["meta_info"]["pulled_tokens"] == held
    assert pulled["meta_info"]["cached_tokens"] == 0
    stats = pull_stats(puller)
    assert stats["pulls"] == 1 and stats["failures"] == stats["refused_slower"] == 0
    assert info(puller)["memserve"]["transfer_time"] == "real" and stats["modelled_s"] == 0
    page_bytes = info(puller)["mempool"]["tiers"]["host"]["block_bytes"]
    assert page_bytes == PAGE * 30 * 2 * 3 * 64 * 4  # SmolLM2-135M's real float32 page
    assert stats["bytes"] == held // PAGE * page_bytes
    assert info(holder)["pull"]["served"] == 1
    no_leak(holder)
    no_leak(puller)

    assert call(puller.url + "/flush_cache", method="POST", raw=b"")[0] == 200
    scratch = greedy(puller, asked)
    assert scratch["meta_info"]["cached_tokens"] == 0 == scratch["meta_info"]["pulled_tokens"]
    assert pulled["output_ids"] == scratch["output_ids"]  # token for token

    # And a chat turn: usage reports the pulled tokens apart from the cached ones.
    messages = [{"role": "user", "content": "Describe a lighthouse at night. " * 12}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    status, first = call(holder.url + "/v1/chat/completions", body, timeout=120)
    assert status == 200, first
    prompt = first["usage"]["prompt_tokens"]
    named = hint(holder, (prompt - 1) // PAGE * PAGE)
    status, second = call(
        puller.url + "/v1/chat/completions", {**body, "memserve": named}, timeout=120
    )
    assert status == 200, second
    details = second["usage"]["prompt_tokens_details"]
    assert details["pulled_tokens"] == (prompt - 1) // PAGE * PAGE > 0
    assert details["cached_tokens"] == 0
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    no_leak(holder)
    no_leak(puller)
