"""The sim worker over real HTTP: SGLang's API, context caching, batching, KV events, errors."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from shared.tokenizer import ChatTokenizer
from tests.http_client import call, stream
from tests.procs import free_port, running

PAGE = 16


def sim_args(model_dir: Path, *extra: str, time_scale: str = "0") -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", time_scale, *extra]


@pytest.fixture(scope="module")
def worker(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    args = sim_args(
        model_dir, "--max-total-tokens", "65536", "--context-length", "4096", time_scale="0"
    )
    with running("connector.worker", args, tmp_path_factory.mktemp("logs")) as server:
        yield server


def prompt_ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def generate(worker, ids: list[int], max_new: int = 8, **extra) -> dict:
    status, body = call(
        worker.url + "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}, **extra},
    )
    assert status == 200, body
    return body


def test_generate_reports_sglang_meta_info(worker) -> None:
    body = generate(worker, prompt_ids(1, 40), max_new=5)
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 40 and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert len(body["output_ids"]) == 5 and isinstance(body["text"], str) and body["text"]


@pytest.mark.parametrize("shared", [17, 40, 95])
def test_cached_tokens_equal_page_aligned_shared_prefix(worker, shared: int) -> None:
    base = prompt_ids(100 + shared, 100)
    generate(worker, base)
    follow = base[:shared] + prompt_ids(999 + shared, 30)
    meta = generate(worker, follow)["meta_info"]
    assert meta["cached_tokens"] == shared // PAGE * PAGE


def test_next_turn_hits_previous_prompt_and_answer(worker) -> None:
    turn1 = prompt_ids(7, 50)
    first = generate(worker, turn1, max_new=30)
    turn2 = turn1 + first["output_ids"] + prompt_ids(8, 10)
    meta = generate(worker, turn2)["meta_info"]
    # KV exists for the prompt and all answer tokens but the last: 79 tokens, 4 whole pages.
    assert meta["cached_tokens"] == (50 + 30 - 1) // PAGE * PAGE


def test_text_prompt_and_streaming_generate(worker) -> None:
    events = stream(
        worker.url + "/generate",
        {
            "text": "The router sends each turn where its prefix lives.",
            "sampling_params": {"max_new_tokens": 6},
            "stream": True,
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == 6
    assert all(last["text"].startswith(c["text"]) for c in chunks)  # cumulative text


def test_chat_applies_the_template_and_streams(worker, model_dir: Path) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    expected = ChatTokenizer(model_dir).encode_chat(
        [messages[0], {"role": "user", "content": "Name a color."}]
    )
    status, body = call(
        worker.url + "/v1/chat/completions", {"model": "x", "messages": messages, "max_tokens": 4}
    )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"
    content = body["choices"][0]["message"]["content"]
    events = stream(
        worker.url + "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == content  # deterministic sim output, same prompt
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == len(expected)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_endpoint(worker) -> None:
    status, body = call(worker.url + "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 3
    events = stream(
        worker.url + "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True}
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]


def test_info_endpoints(worker, model_dir: Path) -> None:
    status, info = call(worker.url + "/get_model_info")
    assert status == 200 and info["model_path"] == str(model_dir) and info["is_generation"]
    status, server = call(worker.url + "/get_server_info")
    assert server["page_size"] == PAGE and server["backend"]["backend"] == "sim"
    assert server["backend"]["latency_model"]["gpu"] == "H100-SXM-80GB"
    # colocated: blocks of the modelled size (a disaggregated sim stores a stand-in page)
    block_bytes = server["mempool"]["tiers"]["host"]["block_bytes"]
    assert server["backend"]["kv_page_bytes"] == 2 * 1024 * 1024 == block_bytes
    assert server["backend"]["latency_model"]["interconnect_bytes_per_s"] == 25e9
    assert "kv_bytes" not in server["backend"] and server["disaggregation"] is None
    status, models = call(worker.url + "/v1/models")
    assert models["data"][0]["max_model_len"] == 4096
    status, loads = call(worker.url + "/v1/loads")
    assert set(loads[0]) == {
        "dp_rank",
        "num_reqs",
        "num_waiting_reqs",
        "num_tokens",
        "num_pending_tokens",
    }
    assert call(worker.url + "/health_generate")[0] == 200
    status, text = call(worker.url + "/metrics")
    assert "sglang:prompt_tokens_total" in text and "sglang:cached_tokens_total" in text


def test_concurrent_requests_are_batched(model_dir: Path, tmp_path: Path) -> None:
    args = sim_args(model_dir, "--max-total-tokens", "65536", time_scale="1")
    with running("connector.worker", args, tmp_path) as server:
        n, max_new = 8, 32
        with ThreadPoolExecutor(n) as pool:
            results = list(
                pool.map(lambda i: generate(server, prompt_ids(500 + i, 64), max_new), range(n))
            )
        assert all(r["meta_info"]["completion_tokens"] == max_new for r in results)
        busy = call(server.url + "/get_server_info")[1]["backend"]["simulated_busy_s"]
        # One request alone decodes max_new steps of >= 6.8 ms each; run one after another,
        # eight would keep the GPU busy 8x that. Batched, they share the steps.
        one_alone = max_new * 0.0068
        assert busy < 0.5 * n * one_alone, busy


def test_flush_cache_empties_the_cache(worker) -> None:
    ids = prompt_ids(42, 64)
    generate(worker, ids)
    assert generate(worker, ids)["meta_info"]["cached_tokens"] == 48
    status, _ = call(worker.url + "/flush_cache", method="POST", raw=b"")
    assert status == 200
    assert call(worker.url + "/get_server_info")[1]["mempool"]["cached_tokens"] == 0
    assert generate(worker, ids)["meta_info"]["cached_tokens"] == 0


def test_kv_events_reach_a_zmq_subscriber(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")  # the worker connects to a concrete address
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
    args = sim_args(
        model_dir, "--max-total-tokens", "128", "--kv-events-config", config, time_scale="0"
    )
    try:
        with running("connector.worker", args, tmp_path) as server:
            events = []

            def drain(until: type, timeout_ms: int = 5000) -> None:
                while sub.poll(timeout_ms):
                    _topic, seq, payload = sub.recv_multipart()
                    assert len(seq) == 8
                    events.extend(decode_batch(payload).events)
                    if any(isinstance(e, until) for e in events):
                        return
                raise AssertionError(f"no {until.__name__} in {events}")

            # ZMQ subscriptions take a moment to propagate: new prompts until one is heard.
            sent = []
            for attempt in range(20):
                sent.append(prompt_ids(100 + attempt, 40))
                generate(server, sent[-1], max_new=9)
                if sub.poll(500):
                    break
            drain(BlockStored)
            stored = next(e for e in events if isinstance(e, BlockStored))
            assert stored.block_size == PAGE and stored.parent_block_hash is None
            # the prompt's whole pages, stored once prefilled (its answer's page follows later)
            assert any(stored.token_ids[:32] == p[:32] for p in sent)
            assert len(stored.token_ids) == PAGE * len(stored.block_hashes)
            # 128 tokens of capacity: new prompts evict the old pages.
            for seed in range(2, 6):
                generate(server, prompt_ids(seed, 40), max_new=9)
            drain(BlockRemoved)
            assert call(server.url + "/flush_cache", method="POST", raw=b"")[0] == 200
            drain(AllBlocksCleared)
    finally:
        sub.close(linger=0)


@pytest.mark.parametrize(
    ("path", "payload", "needle"),
    [
        ("/generate", b"{not json", "not valid JSON"),
        ("/generate", b"[1, 2]", "JSON object"),
        ("/generate", b'{"sampling_params": {}}', "exactly one of 'text' or 'input_ids'"),
        ("/generate", b'{"text": "a", "input_ids": [1]}', "exactly one"),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -3}}', ">= 0"),
        ("/generate", b'{"text": "a", "sampling_params": {"temperature": "hot"}}', "number"),
        ("/generate", b'{"text": "a", "sampling_params": {"top_k": 0}}', "top_k"),
        ("/generate", b'{"text": "a", "sampling_params": {"bogus": 1}}', "unknown sampling"),
        ("/generate", b'{"text": "a", "stream": "yes"}', "'stream'"),
        ("/generate", b'{"text": 5}', "'text'"),
        ("/generate", b'{"input_ids": [1, -2]}', "input_ids"),
        ("/generate", b'{"input_ids": []}', "empty"),
        ("/generate", b'{"text": "a", "rid": 7}', "'rid'"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "content"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
            "integer",
        ),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "'prompt'"),
    ],
)
def test_bad_input_is_a_json_400(worker, path: str, payload: bytes, needle: str) -> None:
    status, body = call(worker.url + path, raw=payload)
    assert status == 400, body
    assert body["object"] == "error" and body["code"] == 400
    assert needle in body["message"]


def test_prompt_longer_than_context_is_refused_and_worker_keeps_serving(worker) -> None:
    status, body = call(worker.url + "/generate", {"input_ids": prompt_ids(3, 5000)})
    assert status == 400 and "context" in body["message"]
    assert generate(worker, prompt_ids(3, 20), max_new=2)["meta_info"]["completion_tokens"] == 2


def test_unknown_route_is_a_json_404(worker) -> None:
    status, body = call(worker.url + "/nope")
    assert status == 404 and body["code"] == 404


def test_disconnected_stream_is_aborted_and_its_memory_freed(
    model_dir: Path, tmp_path: Path
) -> None:
    import http.client
    import time

    args = sim_args(model_dir, "--max-total-tokens", "65536", time_scale="1")
    with running("connector.worker", args, tmp_path) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request(
            "POST",
            "/generate",
            body=json.dumps(
                {
                    "input_ids": prompt_ids(9, 40),
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 5000},
                }
            ),
        )
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")  # it is generating
        conn.close()  # the client goes away
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            load = call(server.url + "/get_load")[1][0]
            if load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                break
            time.sleep(0.1)
        assert load["num_reqs"] == 0, load
        metrics = call(server.url + "/metrics")[1]
        assert "sglang:num_aborted_requests_total{model_name=" in metrics
        aborted = [
            ln for ln in metrics.splitlines() if ln.startswith("sglang:num_aborted_requests_total")
        ]
        assert float(aborted[0].split()[-1]) == 1.0
        # Its pages went back to the cache (historical, evictable), none stay held.
        mempool = call(server.url + "/get_server_info")[1]["mempool"]
        assert mempool["protected_pages"] == 0


def test_request_outgrowing_the_cache_is_aborted_cleanly(model_dir: Path, tmp_path: Path) -> None:
    args = sim_args(model_dir, "--max-total-tokens", "64", time_scale="0")
    with running("connector.worker", args, tmp_path) as server:
        body = generate(server, prompt_ids(5, 40), max_new=100)
        reason = body["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "KV cache" in reason["message"]
        assert body["meta_info"]["completion_tokens"] < 100
        # The instance is intact: a request that fits still runs.
        assert generate(server, prompt_ids(6, 20), max_new=4)["meta_info"]["completion_tokens"] == 4
        tiers = call(server.url + "/get_server_info")[1]["mempool"]["tiers"]
        assert tiers["host"]["used"] <= 4


def test_tokenizer_cache_gives_the_engine_tokens_turn_after_turn(
    worker, model_dir: Path, tmp_path: Path
) -> None:
    history = [{"role": "system", "content": "Answer briefly. " * 30}]
    args = sim_args(model_dir, "--tokenizer-cache")
    with running("connector.worker", args, tmp_path) as cached:
        for turn in range(3):
            history.append({"role": "user", "content": f"Question {turn}: why is the sky blue?"})
            usage = {}
            for server in (worker, cached):
                status, body = call(
                    server.url + "/v1/chat/completions",
                    {"messages": history, "max_tokens": 4, "temperature": 0},
                )
                assert status == 200, body
                usage[server.url] = body["usage"]["prompt_tokens"]
            assert usage[worker.url] == usage[cached.url]
            history.append({"role": "assistant", "content": f"Because of scattering, {turn}."})
        # /flush_cache empties it too: a flushed worker encodes as one that never saw the
        # text (benchmarks flush between the systems they compare)
        pieces = call(cached.url + "/get_server_info")[1]["tokenizer_cache"]["cached_pieces"]
        assert pieces > 0
        assert call(cached.url + "/flush_cache", method="POST", raw=b"")[0] == 200
        assert call(cached.url + "/get_server_info")[1]["tokenizer_cache"]["cached_pieces"] == 0
        status, body = call(cached.url + "/v1/chat/completions", {"messages": []})
        assert status == 400 and "messages" in body["message"]
