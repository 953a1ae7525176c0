"""Cache namespaces and LoRA adapters on the sim worker over real HTTP (issue 38, worker side).

Each test fails without its feature: salts, extra keys and adapters that shared a prefix
would report cached tokens where these expect none.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.kv_events import BlockStored, decode_batch
from shared.namespaces import CacheNamespace
from tests.connector.test_worker_sim import PAGE, generate, prompt_ids, sim_args
from tests.http_client import call
from tests.procs import free_port, running

ADAPTERS = [
    "alpha=/adapters/alpha",
    "beta=/adapters/beta",
    "gamma=/adapters/gamma",
    '{"lora_name": "keep", "lora_path": "/adapters/keep", "pinned": true}',
]


@pytest.fixture(scope="module")
def worker(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    args = sim_args(
        model_dir,
        "--max-total-tokens",
        "65536",
        "--context-length",
        "4096",
        "--lora-paths",
        *ADAPTERS,
        "--max-loaded-loras",
        "3",
        "--max-loras-per-batch",
        "2",
        time_scale="0",
    )
    with running("connector.worker", args, tmp_path_factory.mktemp("logs")) as server:
        yield server


def cached(worker, ids: list[int], **extra) -> int:
    return generate(worker, ids, max_new=2, **extra)["meta_info"]["cached_tokens"]


def lora_info(worker) -> dict:
    status, info = call(worker.url + "/get_server_info")
    assert status == 200
    return info["lora"]


def resident(worker) -> set[str]:
    return {a["lora_name"] for a in lora_info(worker)["adapters"] if a["resident"]}


# ----------------------------------------------------------------- salts and extra keys


def test_another_salt_gets_no_cached_tokens_the_same_salt_does(worker) -> None:
    ids = prompt_ids(1, 80)
    assert cached(worker, ids, cache_salt="tenant-a") == 0
    assert cached(worker, ids, cache_salt="tenant-b") == 0  # the victim's prompt, not shared
    assert cached(worker, ids) == 0  # nor with a request without a salt
    assert cached(worker, ids, cache_salt="tenant-a") == 64  # its own namespace hits
    assert cached(worker, ids, cache_salt="tenant-b") == 64


def test_unsalted_cache_is_not_read_by_a_salted_request(worker) -> None:
    ids = prompt_ids(2, 80)
    assert cached(worker, ids) == 0
    assert cached(worker, ids) == 64
    assert cached(worker, ids, cache_salt="x") == 0


def test_extra_key_is_a_namespace_apart_from_the_salt(worker) -> None:
    ids = prompt_ids(3, 80)
    assert cached(worker, ids, extra_key="k1") == 0
    assert cached(worker, ids, extra_key="k2") == 0
    assert cached(worker, ids, extra_key="k1", cache_salt="s") == 0
    assert cached(worker, ids, extra_key="k1") == 64
    assert cached(worker, ids, extra_key="k1", cache_salt="s") == 64
    # (extra_key, salt) is not one concatenated string: "k1" + "s" is not "k1s" + none
    assert cached(worker, ids, extra_key="k1s") == 0


def test_public_prefix_is_shared_across_salts_and_the_rest_is_not(worker) -> None:
    public = prompt_ids(4, 40)  # 2 whole pages (32 tokens) shared; 8 tokens go with the rest
    private = prompt_ids(5, 40)
    ids = public + private
    a = {"cache_salt": "tenant-a", "shared_prefix_tokens": 40}
    b = {"cache_salt": "tenant-b", "shared_prefix_tokens": 40}
    assert cached(worker, ids, **a) == 0
    assert cached(worker, ids, **b) == 32  # the public pages only: the private text is not
    assert cached(worker, ids, **a) == 64  # (the prompt less its last token, whole pages)
    assert cached(worker, public + prompt_ids(6, 40)) == 32  # an unsalted request shares it


def test_public_prefix_does_not_open_a_namespace_keyed_by_extra_key(worker) -> None:
    ids = prompt_ids(7, 80)
    generate(worker, ids, max_new=2, extra_key="e1", cache_salt="a", shared_prefix_tokens=48)
    assert cached(worker, ids, extra_key="e1", cache_salt="b", shared_prefix_tokens=48) == 48
    assert cached(worker, ids, extra_key="e2", cache_salt="a", shared_prefix_tokens=48) == 0
    assert cached(worker, ids, cache_salt="a", shared_prefix_tokens=48) == 0


def test_salt_on_openai_routes(worker) -> None:
    body = {"prompt": prompt_ids(8, 70), "max_tokens": 2}
    assert call(worker.url + "/v1/completions", {**body, "cache_salt": "t1"})[0] == 200
    status, out = call(worker.url + "/v1/completions", {**body, "cache_salt": "t2"})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, out = call(worker.url + "/v1/completions", {**body, "cache_salt": "t1"})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_namespace_keys_are_prefix_stable_and_disjoint() -> None:
    tokens = list(range(100, 180))
    a = CacheNamespace(cache_salt="a")
    b = CacheNamespace(cache_salt="b")
    assert a.key(tokens, PAGE)[:PAGE] != b.key(tokens, PAGE)[:PAGE]
    assert a.key(tokens, PAGE)[PAGE:] == tokens[PAGE:]  # only the first page is derived
    assert a.key(tokens[:40], PAGE) == a.key(tokens, PAGE)[:40]
    assert all(t >= 1 << 31 for t in a.key(tokens, PAGE)[:PAGE])
    shared = CacheNamespace(cache_salt="a", shared_prefix_tokens=40)
    assert shared.key(tokens, PAGE)[:32] == tokens[:32]  # 40 rounded down to 2 pages
    assert shared.key(tokens, PAGE)[32:48] != tokens[32:48]


# ----------------------------------------------------------------- LoRA adapters


def test_two_adapters_never_share_a_prefix(worker) -> None:
    ids = prompt_ids(20, 80)
    assert cached(worker, ids, lora_path="alpha") == 0
    assert cached(worker, ids, lora_path="beta") == 0
    assert cached(worker, ids) == 0  # the base model neither
    assert cached(worker, ids, lora_path="alpha") == 64
    body: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": 2,
        "model": "base:beta",
        "lora_path": "alpha",
    }
    status, out = call(worker.url + "/v1/completions", body)  # "base:adapter" wins
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    body["prompt"] = prompt_ids(21, 80)
    call(worker.url + "/v1/completions", body)
    assert cached(worker, body["prompt"], lora_path="alpha") == 0
    assert cached(worker, body["prompt"], lora_path="beta") == 64


def test_unknown_adapter_is_a_json_400(worker) -> None:
    status, body = call(
        worker.url + "/generate",
        {"input_ids": prompt_ids(22, 20), "lora_path": "nope", "sampling_params": {}},
    )
    assert status == 400 and "not loaded" in body["message"] and "nope" in body["message"]
    status, body = call(
        worker.url + "/v1/chat/completions",
        {"model": "base:nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 400 and body["object"] == "error" and "nope" in body["message"]


def test_models_and_server_info_list_the_adapters(worker) -> None:
    status, models = call(worker.url + "/v1/models")
    assert status == 200
    cards = {card["id"]: card for card in models["data"]}
    base = models["data"][0]["id"]
    for name in ("alpha", "beta", "gamma", "keep"):
        assert cards[name]["parent"] == base and cards[name]["root"] == f"/adapters/{name}"
    info = lora_info(worker)
    assert info["max_loaded_loras"] == 3 and info["max_loras_per_batch"] == 2
    assert info["lora_eviction_policy"] == "lru"
    keep = next(a for a in info["adapters"] if a["lora_name"] == "keep")
    assert keep["pinned"] and keep["resident"]


def test_lru_eviction_at_max_loaded_loras_and_pinned_adapter_stays(worker) -> None:
    # 3 slots, "keep" pinned in one: alpha, beta, gamma take turns in the other two.
    for name in ("alpha", "beta"):
        cached(worker, prompt_ids(30, 20), lora_path=name)
    assert resident(worker) == {"keep", "alpha", "beta"}
    cached(worker, prompt_ids(30, 20), lora_path="alpha")  # alpha used last: beta is LRU
    loads = lora_info(worker)["loads"]
    cached(worker, prompt_ids(30, 20), lora_path="gamma")
    assert resident(worker) == {"keep", "alpha", "gamma"}
    info = lora_info(worker)
    assert info["loads"] == loads + 1 and info["evictions"] >= 1
    for name in ("beta", "gamma", "alpha", "beta"):
        cached(worker, prompt_ids(31, 20), lora_path=name)
        assert "keep" in resident(worker)


def test_load_and_unload_endpoints(worker) -> None:
    url = worker.url
    status, body = call(url + "/load_lora_adapter", {"lora_name": "delta", "lora_path": "/d"})
    assert status == 200 and body["success"] is True and body["error_message"] is None
    assert body["loaded_adapters"]["delta"] == "/d"
    ids = prompt_ids(40, 60)
    assert cached(worker, ids, lora_path="delta") == 0
    assert cached(worker, ids, lora_path="delta") == 48
    status, body = call(url + "/load_lora_adapter", {"lora_name": "delta", "lora_path": "/x"})
    assert status == 400 and body["success"] is False and "already loaded" in body["error_message"]
    status, body = call(url + "/unload_lora_adapter", {"lora_name": "delta"})
    assert status == 200 and body["success"] and "delta" not in body["loaded_adapters"]
    status, body = call(
        url + "/generate", {"input_ids": ids, "lora_path": "delta", "sampling_params": {}}
    )
    assert status == 400
    status, body = call(url + "/unload_lora_adapter", {"lora_name": "delta"})
    assert status == 400 and body["success"] is False
    # Loaded again: a new lora_id, a new namespace; the old KV is not reused.
    assert call(url + "/load_lora_adapter", {"lora_name": "delta", "lora_path": "/d"})[0] == 200
    assert cached(worker, ids, lora_path="delta") == 0
    assert call(url + "/unload_lora_adapter", {"lora_name": "delta"})[0] == 200


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/load_lora_adapter", b"{bad"),
        ("/load_lora_adapter", b"[1]"),
        ("/load_lora_adapter", b'{"lora_name": "x"}'),
        ("/load_lora_adapter", b'{"lora_name": 3, "lora_path": "p"}'),
        ("/load_lora_adapter", b'{"lora_name": "x", "lora_path": "p", "pinned": "yes"}'),
        ("/unload_lora_adapter", b"{}"),
        ("/unload_lora_adapter", b'"alpha"'),
        ("/generate", b'{"input_ids": [1, 2], "cache_salt": 5}'),
        ("/generate", b'{"input_ids": [1, 2], "extra_key": ["a"]}'),
        ("/generate", b'{"input_ids": [1, 2], "lora_path": ["alpha", "beta"]}'),
        ("/generate", b'{"input_ids": [1, 2], "cache_salt": "a", "shared_prefix_tokens": -1}'),
        ("/generate", b'{"input_ids": [1, 2], "shared_prefix_tokens": "10"}'),
        ("/v1/completions", b'{"prompt": [1, 2], "model": 7}'),
        ("/v1/completions", b'{"prompt": [1, 2], "model": "base:"}'),
    ],
)
def test_bad_bodies_are_json_4xx_never_500(worker, path: str, payload: bytes) -> None:
    status, body = call(worker.url + path, raw=payload, method="POST")
    assert 400 <= status < 500, body
    assert isinstance(body, dict)


def test_adapters_per_batch_limit_serves_every_request(worker) -> None:
    """Concurrent requests over four adapters with two per batch: all finish."""
    names = ["alpha", "beta", "gamma", "keep"] * 3

    def one(name: str) -> dict:
        return generate(worker, prompt_ids(50, 30), max_new=4, lora_path=name)

    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(one, names))
    assert all(len(o["output_ids"]) == 4 for o in outs)


def test_small_pages_refuse_namespaces(model_dir: Path, tmp_path: Path) -> None:
    args = sim_args(model_dir, "--page-size", "4", "--max-total-tokens", "4096")
    with running("connector.worker", args, tmp_path) as server:
        status, body = call(
            server.url + "/generate",
            {"input_ids": prompt_ids(60, 20), "cache_salt": "a", "sampling_params": {}},
        )
        assert status == 400 and "--page-size" in body["message"]
        assert generate(server, prompt_ids(60, 20))["meta_info"]["prompt_tokens"] == 20


def test_namespaced_kv_events_keep_namespaces_apart(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
    args = sim_args(model_dir, "--kv-events-config", config, "--lora-paths", "alpha=/a")
    events: list[BlockStored] = []
    try:
        with running("connector.worker", args, tmp_path) as server:
            for attempt in range(20):  # until the subscription is heard
                generate(server, prompt_ids(200 + attempt, 40), max_new=2)
                if sub.poll(500):
                    break
            while sub.poll(300):
                sub.recv_multipart()
            public, private = prompt_ids(70, 32), prompt_ids(71, 48)
            generate(
                server,
                public + private,
                max_new=2,
                cache_salt="s1",
                shared_prefix_tokens=32,
                lora_path="alpha",
            )
            generate(server, public + private, max_new=2)
            while sub.poll(1000):
                batch = decode_batch(sub.recv_multipart()[2])
                events += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        sub.close(linger=0)
    salted = [e for e in events if e.metadata is not None and e.metadata.cache_salt == "s1"]
    public_runs = [e for e in events if e.metadata is not None and e.metadata.cache_salt is None]
    plain = [e for e in events if e.metadata is None]
    assert salted and public_runs and plain
    assert all(
        e.metadata is not None and e.metadata.lora_name == "alpha" and e.lora_id is not None
        for e in salted
    )
    assert public_runs[0].token_ids[:32] == public  # real tokens, adapter-keyed hashes
    assert salted[0].token_ids[:PAGE] == private[:PAGE]
    adapter_hashes = {h for e in salted + public_runs for h in e.block_hashes}
    assert not adapter_hashes & {h for e in plain for h in e.block_hashes}
