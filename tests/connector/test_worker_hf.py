"""The real tiny model behind the worker's HTTP API: caching changes speed, never tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.tokenizer import ChatTokenizer
from tests.http_client import call, stream
from tests.procs import running
from tests.tokenizer_families import shared_start

PAGE = 16
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}


@pytest.fixture(scope="module")
def worker(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--backend", "hf", "--model-path", str(model_dir), "--max-total-tokens", "4096"]
    with running("connector.worker", args, tmp_path_factory.mktemp("logs"), timeout=180) as s:
        yield s


def greedy(worker, ids: list[int], max_new: int = 16) -> dict:
    status, body = call(
        worker.url + "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}},
    )
    assert status == 200, body
    return body


def test_second_turn_reuses_first_turn_and_output_is_unchanged(worker, model_dir: Path) -> None:
    tok = ChatTokenizer(model_dir)
    turn1 = [SYSTEM, {"role": "user", "content": "Name the largest planet."}]
    first = greedy(worker, tok.encode_chat(turn1))
    answer = tok.decode(first["output_ids"])
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "How many moons does it have?"},
    ]
    ids2 = tok.encode_chat(turn2)
    computed = tok.encode_chat(turn1) + first["output_ids"][:-1]  # KV exists for these
    expected = min(shared_start(ids2, computed), len(ids2) - 1) // PAGE * PAGE
    hit = greedy(worker, ids2)
    assert hit["meta_info"]["cached_tokens"] == expected > len(tok.encode_chat(turn1)) - PAGE
    assert call(worker.url + "/flush_cache", method="POST", raw=b"")[0] == 200
    cold = greedy(worker, ids2)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert hit["output_ids"] == cold["output_ids"]  # token for token


def test_chat_streams_real_text(worker) -> None:
    messages = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    status, body = call(
        worker.url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 12, "temperature": 0},
    )
    assert status == 200
    text = body["choices"][0]["message"]["content"]
    assert "Paris" in text
    events = stream(
        worker.url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True},
    )
    streamed = "".join(
        e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]
    )
    assert streamed == text


def test_stop_string_trims_output(worker) -> None:
    status, body = call(
        worker.url + "/v1/chat/completions",
        {
            "messages": [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["Paris"],
        },
    )
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "Paris" not in body["choices"][0]["message"]["content"]
