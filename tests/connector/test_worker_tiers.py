"""The host tier and chunked prefill in real worker processes, over HTTP and ZMQ.

Sim workers: a prompt pushed out of device memory comes back from the host tier (its load
time modelled and counted, every move published as KV events with SGLang's `medium`), a full
host tier drops its oldest pages without leaking a block, and a long prompt is prefilled a
chunk a step while decodes keep going. The real tiny model: greedy output after a host hit,
and chunked, is token for token the output computed from scratch. Bad flags stop the worker
with one line.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from connector.worker.latency_model import LatencyModel
from shared.kv_events import BlockRemoved, BlockStored, decode_batch, page_hashes
from shared.tokenizer import ChatTokenizer
from tests.http_client import call
from tests.procs import ROOT, TEST_ENV, Server, free_port, running

PAGE = 16


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def generate(url: str, prompt: list[int], max_new: int = 8, **sampling: Any) -> dict[str, Any]:
    status, body = call(
        url + "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, **sampling}},
    )
    assert status == 200, body
    return body


def sim_args(model_dir: Path, *extra: str, time_scale: str = "0") -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", time_scale, *extra]


class Events:
    """A real ZMQ SUB socket the worker publishes its KV events to."""

    def __init__(self) -> None:
        self.port = free_port()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.events: list[Any] = []

    def config(self) -> str:
        return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.port}"})

    def hear(self, url: str) -> None:
        """ZMQ subscriptions take a moment to propagate: small prompts until one is heard."""
        for attempt in range(20):
            generate(url, ids(900 + attempt, 40))
            if self.drain(200):
                return
        raise AssertionError("no KV events heard")

    def drain(self, wait_ms: int = 300) -> list[Any]:
        while self.sock.poll(wait_ms):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events.extend(decode_batch(payload).events)
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)


def server_info(url: str) -> dict[str, Any]:
    status, info = call(url + "/get_server_info")
    assert status == 200
    return info


def assert_no_leak(info: dict[str, Any]) -> None:
    """With no request running, every block in use on either tier is an indexed page."""
    mempool = info["mempool"]
    used = sum(tier["used"] for tier in mempool["tiers"].values())
    assert used * PAGE == mempool["cached_tokens"] and mempool["protected_pages"] == 0


@contextlib.contextmanager
def hicache_worker(
    model_dir: Path, log_dir: Path, flag: str, ratio: str
) -> Iterator[tuple[Server, Events]]:
    """A sim worker with 256 tokens of device KV and a host tier of `ratio` x that, its KV
    events heard on a SUB socket of ours."""
    events = Events()
    args = sim_args(model_dir, flag, "--max-total-tokens", "256", "--hicache-ratio", ratio)
    args += ["--kv-events-config", events.config()]
    try:
        with running("connector.worker", args, log_dir) as w:
            events.hear(w.url)
            yield w, events
    finally:
        events.close()


def test_host_tier_hit_after_eviction_with_events(model_dir: Path, tmp_path: Path) -> None:
    flag = "--enable-hierarchical-cache"
    with hicache_worker(model_dir, tmp_path, flag, "2") as (worker, events):
        info = server_info(worker.url)
        assert info["max_total_num_tokens"] == 256
        assert info["kv_tiers"]["host"]["capacity_tokens"] == 512
        assert info["backend"]["kv_page_bytes"] == 256  # stand-in pages where KV moves
        for name in ("device", "host"):
            assert info["mempool"]["tiers"][name]["block_bytes"] == 256

        prompt = ids(1, 100)
        assert generate(worker.url, prompt)["meta_info"]["cached_tokens"] == 0
        for seed in (2, 3, 4):  # 7 blocks each on a 16-block device: `prompt` goes out
            generate(worker.url, ids(seed, 100))
        again = generate(worker.url, prompt)["meta_info"]
        assert again["cached_tokens"] == 96
        assert again["cached_tokens_details"] == {"device": 0, "host": 96}

        info = server_info(worker.url)
        host = info["kv_tiers"]["host"]
        model = LatencyModel()
        assert host["hit_tokens"] == 96 and host["swapped_in_tokens"] >= 96
        assert host["seconds"] == "modelled"
        load = model.host_copy_s(96 // PAGE, PAGE)
        assert host["load_s"] == pytest.approx(load, abs=2e-6)
        assert info["backend"]["simulated_load_s"] == pytest.approx(load, abs=2e-6)
        assert host["swap_out_s"] > 0 and host["swapped_out_tokens"] >= 96
        metrics = call(worker.url + "/metrics")[1]
        assert 'cache_source="host"' in metrics and "sglang:hicache_host_total_tokens" in metrics
        assert_no_leak(info)

        hashes = page_hashes(prompt[:96], PAGE)
        seen = events.drain()

        def where(kind: type[BlockStored | BlockRemoved], medium: str) -> list[Any]:
            found: list[BlockStored | BlockRemoved] = [e for e in seen if isinstance(e, kind)]
            return [e for e in found if e.medium == medium and hashes[0] in e.block_hashes]

        stored_gpu = where(BlockStored, "GPU")
        out_gpu, in_cpu = where(BlockRemoved, "GPU"), where(BlockStored, "CPU_PINNED")
        out_cpu = where(BlockRemoved, "CPU_PINNED")
        assert stored_gpu and out_gpu and in_cpu and out_cpu  # stored, out, back in
        assert seen.index(out_gpu[0]) + 1 == seen.index(in_cpu[0])  # removed, then stored
        moved = in_cpu[0]
        assert moved.parent_block_hash is None and moved.block_size == PAGE
        first = moved.block_hashes.index(hashes[0])
        assert moved.token_ids[first * PAGE : (first + 1) * PAGE] == prompt[:PAGE]
        loaded = seen[seen.index(out_cpu[0]) :]  # the load: back from host, in on device
        assert isinstance(loaded[1], BlockStored) and loaded[1].medium == "GPU"
        back = {h for e in loaded if isinstance(e, BlockStored) for h in e.block_hashes}
        left = {h for e in loaded if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert set(hashes) <= back & left


def test_full_host_tier_drops_its_oldest_pages_and_leaks_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    with hicache_worker(model_dir, tmp_path, "--enable-hicache", "1") as (worker, events):
        prompts = [ids(100 + i, 100) for i in range(8)]  # 8 x 6 pages on 16 + 16
        for p in prompts:
            generate(worker.url, p)
        info = server_info(worker.url)
        tiers = info["kv_tiers"]
        assert tiers["host"]["used_tokens"] <= tiers["host"]["capacity_tokens"] == 256
        assert tiers["host"]["dropped_tokens"] > 0 and tiers["device"]["dropped_tokens"] == 0
        assert_no_leak(info)
        oldest, newest = prompts[0], prompts[-1]
        assert generate(worker.url, newest)["meta_info"]["cached_tokens_details"] == {
            "device": 96,
            "host": 0,
        }
        assert generate(worker.url, prompts[4])["meta_info"]["cached_tokens_details"]["host"] == 96
        assert generate(worker.url, oldest)["meta_info"]["cached_tokens"] == 0  # dropped
        seen = events.drain(1000)
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU_PINNED" for e in seen)
        assert_no_leak(server_info(worker.url))


def test_chunked_prefill_takes_exactly_the_modelled_steps(model_dir: Path, tmp_path: Path) -> None:
    model = LatencyModel()
    args = sim_args(model_dir, "--chunked-prefill-size", "1024", "--max-total-tokens", "65536")
    with running("connector.worker", args, tmp_path) as worker:
        assert server_info(worker.url)["chunked_prefill_size"] == 1024
        body = generate(worker.url, ids(7, 3000), max_new=1)
        assert body["meta_info"]["prompt_tokens"] == 3000
        assert body["meta_info"]["completion_tokens"] == 1
        chunks = [(1024, 0), (1024, 1024), (952, 2048)]
        want = sum(model.step_s([c], 0, 0) for c in chunks)
        busy = server_info(worker.url)["backend"]["simulated_busy_s"]
        assert busy == pytest.approx(want, abs=2e-6)
        assert busy > model.step_s([(3000, 0)], 0, 0)  # three steps, three overheads


def test_default_sim_chunk_is_sglangs_and_can_be_disabled(model_dir: Path, tmp_path: Path) -> None:
    model = LatencyModel()
    with running("connector.worker", sim_args(model_dir), tmp_path) as worker:
        assert server_info(worker.url)["chunked_prefill_size"] == 8192
    args = sim_args(model_dir, "--chunked-prefill-size", "-1", "--max-total-tokens", "65536")
    with running("connector.worker", args, tmp_path) as worker:
        generate(worker.url, ids(8, 3000), max_new=1)
        busy = server_info(worker.url)["backend"]["simulated_busy_s"]
        assert busy == pytest.approx(model.step_s([(3000, 0)], 0, 0), abs=2e-6)


def test_decode_keeps_going_while_a_long_prompt_prefills(model_dir: Path, tmp_path: Path) -> None:
    """A 12K-token prompt in 2K chunks: six steps before its first token, each also carrying
    the running decode's next token."""
    args = sim_args(
        model_dir,
        "--chunked-prefill-size",
        "2048",
        "--max-total-tokens",
        "65536",
        "--context-length",
        "32768",
        time_scale="1",
    )
    with running("connector.worker", args, tmp_path) as worker:
        decode_times: list[float] = []
        last: list[dict[str, Any]] = []
        started = threading.Event()

        def decode() -> None:
            body = {
                "input_ids": ids(9, 64),
                "sampling_params": {"max_new_tokens": 200},
                "stream": True,
            }
            req = urllib.request.Request(
                worker.url + "/generate", data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                for line in resp:
                    if line.startswith(b"data: {"):
                        decode_times.append(time.monotonic())
                        last[:] = [json.loads(line[len(b"data: ") :])]
                        started.set()

        thread = threading.Thread(target=decode)
        thread.start()
        assert started.wait(30)
        time.sleep(0.1)
        sent = time.monotonic()
        long = generate(worker.url, ids(10, 12000), max_new=1)
        first_token = time.monotonic()
        thread.join(60)
        assert long["meta_info"]["prompt_tokens"] == 12000
        assert long["meta_info"]["completion_tokens"] == 1
        during = [t for t in decode_times if sent < t < first_token]
        # Six chunk steps (about 90 ms of modelled time each): the decode gets a token in
        # each; unchunked it would wait out one 0.5 s step.
        assert len(during) >= 4, (len(during), first_token - sent)
        assert first_token - sent > 0.4
        gaps = sorted(b - a for a, b in itertools.pairwise(during))
        # One gap may stretch when the machine's other work takes the core (a parallel test
        # run); the typical one is a chunk step.
        assert gaps[len(gaps) // 2] < 0.3, gaps
        assert last[0]["meta_info"]["completion_tokens"] == 200 == len(last[0]["output_ids"])
        assert last[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
        status, load = call(worker.url + "/get_load")
        assert status == 200 and load[0]["num_reqs"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--hicache-ratio", "2"], "--hicache-ratio needs --enable-hierarchical-cache"),
        (["--hicache-size", "4"], "--hicache-size needs --enable-hierarchical-cache"),
        (["--enable-hicache", "--hicache-ratio", "0"], "--hicache-ratio must be a positive"),
        (["--enable-hicache", "--hicache-ratio", "-1.5"], "--hicache-ratio must be a positive"),
        (["--enable-hicache", "--hicache-ratio", "nan"], "--hicache-ratio must be a positive"),
        (["--enable-hicache", "--hicache-size", "-3"], "--hicache-size must be >= 0"),
        (
            ["--enable-hicache", "--hicache-ratio", "0.01", "--max-total-tokens", "256"],
            "less than a page",
        ),
        (["--enable-hicache", "--disable-radix-cache"], "needs the radix cache"),
        (["--chunked-prefill-size", "8"], "--chunked-prefill-size 8 is below a page"),
    ],
)
def test_bad_flags_stop_the_worker_with_one_line(
    model_dir: Path, flags: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "connector.worker", *sim_args(model_dir), "--port", "0", *flags],
        cwd=ROOT,
        env={**TEST_ENV, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_hicache_size_counts_gigabytes_of_modelled_pages(model_dir: Path, tmp_path: Path) -> None:
    args = sim_args(
        model_dir,
        "--enable-hierarchical-cache",
        "--max-total-tokens",
        "4096",
        "--hicache-size",
        "1",
    )
    with running("connector.worker", args, tmp_path) as worker:
        host = server_info(worker.url)["kv_tiers"]["host"]
        per_token = LatencyModel().kv_spec(PAGE).bytes_per_token  # 128 KiB: Llama-3.1-8B
        assert host["capacity_tokens"] == int(1e9 // per_token) // PAGE * PAGE


# ----------------------------------------------------------------- the real tiny model

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}


def test_hf_greedy_output_after_a_host_hit_and_chunked_is_the_output_from_scratch(
    model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = ChatTokenizer(model_dir)
    questions = [
        "My garden maple turns bright red every October while the oak next to it goes brown. "
        "Why do leaves change colour in autumn at all, which pigments are involved, and why "
        "do different trees end up with such different colours? Explain the chemistry.",
        "The fridge in my kitchen hums, the back of it is warm, and yet the inside stays "
        "cold for days. How does a refrigerator move heat out of the box, what does the "
        "compressor do, and why does the liquid inside the pipes need to evaporate?",
        "Rivers that flow into the sea carry fresh water, yet the sea itself is salty and "
        "has been for a very long time. Where does the salt in the ocean come from, why do "
        "rivers taste fresh, and why does the sea not get saltier every single year?",
    ]
    prompts = [tok.encode_chat([SYSTEM, {"role": "user", "content": q}]) for q in questions]
    target = prompts[0]
    assert 64 < len(target) < 160
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([target]), max_new_tokens=12, do_sample=False)
    reference = out[0, len(target) :].tolist()
    if 2 in reference:
        reference = reference[: reference.index(2) + 1]
    del model

    args = [
        "--backend",
        "hf",
        "--model-path",
        str(model_dir),
        "--max-total-tokens",
        "128",
        "--enable-hierarchical-cache",
        "--chunked-prefill-size",
        "48",
    ]
    with running("connector.worker", args, tmp_path, timeout=180) as worker:
        cold = generate(worker.url, target, max_new=12, temperature=0)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert cold["output_ids"] == reference  # computed in chunks of 48
        for other in prompts[1:]:  # 8 device pages: `target`'s go to the host tier
            generate(worker.url, other, max_new=12, temperature=0)
        info = server_info(worker.url)
        assert info["kv_tiers"]["host"]["swapped_out_tokens"] > 0
        hot = generate(worker.url, target, max_new=12, temperature=0)
        details = hot["meta_info"]["cached_tokens_details"]
        assert details["host"] > 0 and hot["meta_info"]["cached_tokens"] >= details["host"]
        assert hot["output_ids"] == reference  # loaded from host DRAM, token for token
        info = server_info(worker.url)
        assert info["kv_tiers"]["host"]["seconds"] == "measured"
        assert_no_leak(info)
