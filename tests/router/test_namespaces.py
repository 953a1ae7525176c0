"""The router predicts cached prefixes per cache namespace, as the workers keep them.

A request's `cache_salt`, `extra_key` or adapter puts its KV in a namespace of its own on the
worker (shared.namespaces): the same prompt under another salt reports no cached tokens.
The router's trees must say the same, or it routes a request to a worker for a prefix that
worker will not share with it, and counts hits that never come. Real processes over
loopback: two sim workers publishing KV events to a `prompt_tree` router.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.kv_events.listener import KVEventApplier
from router.request import CHAT, cache_namespace, route_request
from router.trees import PromptTrees
from router.workers import BreakerConfig, WorkerRegistry, WorkerType
from shared.kv_events import BlockRemoved, BlockStored, BlockStoredMetadata, KVEventBatch
from shared.tokenizer import ChatTokenizer
from tests.http_client import call
from tests.procs import free_port, running
from tests.router.test_prefix_prediction import PAGE, ROUTES, Cluster, _body, _served

DOC = " ".join(f"clause {i} of the shared contract says nothing new." for i in range(40))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("namespaces")
    events = free_port()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]

    def worker(i: int) -> list[str]:
        config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": urls[i]}
        return [
            *("--backend", "sim", "--model-path", str(model_dir), "--page-size", str(PAGE)),
            *("--instance-id", str(i + 1), "--kv-events-config", json.dumps(config)),
        ]

    with (
        running("connector.worker", worker(0), root, port=ports[0]),
        running("connector.worker", worker(1), root, port=ports[1]),
        running(
            "router",
            [
                *("--policy", "prompt_tree", "--worker-urls", *urls),
                *("--tokenizer-path", str(model_dir), "--page-size", str(PAGE)),
                *("--kv-events-bind", f"tcp://127.0.0.1:{events}"),
            ],
            root,
        ) as router,
    ):
        yield Cluster(router.url, urls, ChatTokenizer(model_dir))


def _salted(route: str, text: str, salt: str, **more: Any) -> dict[str, Any]:
    return {**_body(route, text), "cache_salt": salt, **more}


@pytest.mark.parametrize("route", ROUTES)
def test_a_prompt_under_another_salt_is_predicted_nowhere(cluster: Cluster, route: str) -> None:
    text = f"{uuid.uuid4().hex} {DOC}"
    _, holder, reported = _served(cluster, route, "", _salted(route, text, "tenant-a"))
    assert reported == 0
    predicted, _, reported = _served(cluster, route, "", _salted(route, text, "tenant-b"))
    assert (predicted, reported) == (0, 0)  # the worker shares nothing: nor do the trees
    predicted, _, reported = _served(cluster, route, "", _body(route, text))
    assert (predicted, reported) == (0, 0)  # nor with the unsalted prompt
    predicted, worker, reported = _served(cluster, route, "", _salted(route, text, "tenant-a"))
    assert worker == holder and reported >= 20 * PAGE
    assert reported - PAGE <= predicted <= reported, (predicted, reported)


def test_a_public_prefix_is_predicted_across_salts_and_the_rest_is_not(cluster: Cluster) -> None:
    ids = cluster.tokenizer.encode(f"{uuid.uuid4().hex} {DOC}")
    public = 12 * PAGE

    def body(salt: str, tail: list[int]) -> dict[str, Any]:
        return {
            "input_ids": ids + tail,
            "sampling_params": {"max_new_tokens": 1},
            "cache_salt": salt,
            "shared_prefix_tokens": public,
        }

    _, holder, _ = _served(cluster, "/generate", "", body("tenant-a", [5] * 40))
    predicted, worker, reported = _served(cluster, "/generate", "", body("tenant-b", [5] * 40))
    assert worker == holder and reported == public  # the public part only
    assert predicted == public
    predicted, _, reported = _served(cluster, "/generate", "", body("tenant-a", [7] * 40))
    assert predicted == reported == len(ids) // PAGE * PAGE  # its own salted rest too


def test_kv_events_of_namespaced_pages_are_keyed_as_requests(cluster: Cluster) -> None:
    """Traffic that bypasses the router: only its worker's KV events tell the trees, and
    they must key the pages in their namespace (a salt and an extra key)."""
    ids = cluster.tokenizer.encode(f"{uuid.uuid4().hex} {DOC}")
    direct = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1},
        "cache_salt": "tenant-c",
        "extra_key": "team-1",
    }
    status, _ = call(cluster.workers[1] + "/generate", direct)
    assert status == 200
    full = (len(ids) - 1) // PAGE * PAGE
    for _ in range(50):  # until its events are applied (the first batches may be lost)
        status, _ = call(cluster.router + "/metrics")
        predicted, worker, reported = _served(cluster, "/generate", "", direct)
        if predicted == full:
            break
    assert worker == cluster.workers[1] and predicted == reported == full
    for other in ({**direct, "extra_key": "team-2"}, {**direct, "cache_salt": "tenant-d"}):
        predicted, _, reported = _served(cluster, "/generate", "", other)
        assert (predicted, reported) == (0, 0)


def test_malformed_namespace_fields_are_refused_before_any_worker(cluster: Cluster) -> None:
    for field, value in (
        ("cache_salt", 5),
        ("extra_key", ["a"]),
        ("shared_prefix_tokens", -1),
        ("shared_prefix_tokens", "3"),
        ("lora_path", {}),
    ):
        status, answer = call(cluster.router + "/generate", {"text": "hi", field: value})
        assert status == 400, (field, answer)
        assert field in answer["message"], answer


# ----------------------------------------------------------------- in process


def test_the_listener_keys_pages_as_the_request_side_does() -> None:
    """A public prefix (plain pages) then salted pages, as a worker publishes them: the
    trees hold the request's key, not the bare tokens; a removed page goes from that key."""
    page = 16
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add("http://127.0.0.1:9300")
    trees = PromptTrees(page_size=page)
    applier = KVEventApplier(trees, registry)
    tokens = list(range(1000, 1000 + 6 * page))
    salted = BlockStoredMetadata(cache_salt="s", extra_key=None, lora_name=None)
    applier.apply(
        worker.url,
        KVEventBatch(
            0.0,
            [
                BlockStored([1, 2], None, tokens[: 2 * page], page, None),
                BlockStored([3, 4, 5, 6], 2, tokens[2 * page :], page, None, None, salted),
            ],
        ),
    )
    body = {"input_ids": tokens, "cache_salt": "s", "shared_prefix_tokens": 2 * page}
    request = route_request("/generate", body, None)
    assert request.namespace == cache_namespace(body)
    key = request.tree_key(tokens, page)
    C = WorkerType.COLOCATED
    assert trees.match(C, key).held == {worker.url: 6 * page}
    assert trees.match(C, tokens).held == {worker.url: 2 * page}  # the public part alone
    other = route_request("/generate", {**body, "cache_salt": "t"}, None)
    assert trees.match(C, other.tree_key(tokens, page)).held == {worker.url: 2 * page}
    applier.apply(worker.url, KVEventBatch(0.0, [BlockRemoved([5, 6])]))
    assert trees.match(C, key).held == {worker.url: 4 * page}


def test_a_namespace_keeps_text_trees_apart_too() -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    plain = route_request(CHAT, body, None)
    salted = route_request(CHAT, {**body, "cache_salt": "s"}, None)
    other = route_request(CHAT, {**body, "cache_salt": "t"}, None)
    assert plain.namespace is None and salted.namespace is not None
    assert len({plain.text, salted.text, other.text}) == 3
    assert salted.text.endswith(plain.text)
