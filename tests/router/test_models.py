"""Several models behind one router (--models, router.models): real sim workers serving two
model names with two tokenizer families, a `prompt_tree` router in front of them.

A request goes only to its model's workers, and its cached tokens are predicted within a
page of what the worker reports; the same prompt under the other model is predicted
nothing; an unknown model is a 404 naming the served ones; /v1/models lists both; a worker
added at run time with `model_id` serves its model, and one removed no longer does; a bad
models file is a clear startup error.
"""

from __future__ import annotations

import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from router.kv_events.listener import KVEventApplier
from router.models import Models, ServedModel, parse_models
from router.policies import RoundRobin
from router.request import RequestError, route_request
from router.trees import PromptTrees
from router.workers import BreakerConfig, WorkerRegistry, WorkerType
from shared.kv_events import BlockRemoved, BlockStored, BlockStoredMetadata, KVEventBatch
from tests.http_client import call
from tests.procs import Server, run_module, running
from tests.tokenizer_families import DEEPSEEK, tokenizer_dir

PAGE = 16
ALPHA, BETA = "alpha", "beta"


@dataclass
class Cluster:
    router: str
    alpha: list[str]  # its workers from the models file
    beta: list[str]
    spare: Server  # a beta worker not registered at start
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("models")
    beta_dir = tokenizer_dir(DEEPSEEK, root / "tokenizers", model_dir)

    def worker(path: Path, name: str, i: int) -> list[str]:
        return [
            *("--backend", "sim", "--model-path", str(path), "--page-size", str(PAGE)),
            *("--served-model-name", name, "--instance-id", str(i)),
        ]

    with (
        running("connector.worker", worker(model_dir, ALPHA, 1), root) as a1,
        running("connector.worker", worker(model_dir, ALPHA, 2), root) as a2,
        running("connector.worker", worker(beta_dir, BETA, 3), root) as b1,
        running("connector.worker", worker(beta_dir, BETA, 4), root) as b2,
    ):
        models = root / "models.toml"
        models.write_text(
            f'[[model]]\nname = "{ALPHA}"\ntokenizer_path = "{model_dir}"\n'
            f'worker_urls = ["{a1.url}", "{a2.url}"]\n\n'
            f'[[model]]\nname = "{BETA}"\ntokenizer_path = "{beta_dir}"\n'
            f'policy = "prompt_tree"\ncache_threshold = 0.5\nworker_urls = ["{b1.url}"]\n'
        )
        args = ["--policy", "prompt_tree", "--models", str(models), "--page-size", str(PAGE)]
        with running("router", args, root) as router:
            yield Cluster(router.url, [a1.url, a2.url], [b1.url], b2, root)


def _processed(cluster: Cluster) -> dict[str, float]:
    """Requests the router sent each worker so far."""
    status, text = call(cluster.router + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('sgl_router_processed_requests_total{worker="'):
            url = line.split('"')[1]
            out[url] = float(line.rsplit(" ", 1)[1])
    return out


def _metric(cluster: Cluster, prefix: str) -> float:
    status, text = call(cluster.router + "/metrics")
    assert status == 200
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


PREDICTED = "memserve_router_predicted_cached_tokens_total"
REPORTED = "memserve_router_reported_cached_tokens_total"


def _send(cluster: Cluster, text: str, model: str | None) -> tuple[str, int, int]:
    """One /generate for `model`: (the worker that served it, the cached tokens the router
    predicted for it, the cached tokens the worker reported)."""
    before, predicted = _processed(cluster), _metric(cluster, PREDICTED)
    reported_before = _metric(cluster, REPORTED)
    body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    if model is not None:
        body["model"] = model
    status, answer = call(cluster.router + "/generate", body)
    assert status == 200, answer
    reported = int(answer["meta_info"]["cached_tokens"])
    deadline = time.monotonic() + 5
    while (
        _metric(cluster, REPORTED) <= reported_before and reported and time.monotonic() < deadline
    ):
        time.sleep(0.01)  # the router learns from the answer just after it
    time.sleep(0.05)
    after = _processed(cluster)
    served = [url for url, n in after.items() if n > before.get(url, 0)]
    assert len(served) == 1, (before, after)
    return served[0], int(_metric(cluster, PREDICTED) - predicted), reported


def _document(words: int = 120) -> str:
    return f"{uuid.uuid4().hex} " + " ".join(f"line {i} of a shared document" for i in range(words))


def test_each_model_goes_to_its_workers_with_its_prefix_predicted(cluster: Cluster) -> None:
    doc = _document()
    for model, workers in ((ALPHA, cluster.alpha), (BETA, cluster.beta)):
        first, predicted, _ = _send(cluster, doc + " first question?", model)
        assert first in workers and predicted == 0
        again, predicted, reported = _send(cluster, doc + " second question?", model)
        assert again == first  # its holder
        assert reported > 200 and abs(predicted - reported) <= PAGE, (predicted, reported)


def test_the_same_prompt_under_the_other_model_is_predicted_nothing(cluster: Cluster) -> None:
    doc = _document()
    served, _, _ = _send(cluster, doc + " q", ALPHA)
    assert served in cluster.alpha
    served, predicted, reported = _send(cluster, doc + " q", BETA)
    assert served in cluster.beta and predicted == 0 and reported == 0


def test_no_model_or_default_goes_to_the_default_model(
    cluster: Cluster,
) -> None:
    for model in (None, "default"):
        served, _, _ = _send(cluster, _document(10), model)
        assert served in cluster.alpha


def test_an_unknown_model_is_a_404_naming_the_served_ones(cluster: Cluster) -> None:
    status, body = call(cluster.router + "/generate", {"text": "hi", "model": "gamma"})
    assert status == 404
    assert "gamma" in body["message"] and "['alpha', 'beta']" in body["message"]


def test_v1_models_lists_every_model_and_server_info_each_ones_workers(cluster: Cluster) -> None:
    status, listed = call(cluster.router + "/v1/models")
    assert status == 200 and listed["object"] == "list"
    assert [m["id"] for m in listed["data"] if m.get("parent") is None] == [ALPHA, BETA]
    status, info = call(cluster.router + "/get_model_info?model=beta")
    assert status == 200 and "deepseek" in info["tokenizer_path"]
    status, info = call(cluster.router + "/get_server_info")
    models = {m["name"]: m for m in info["models"]}
    assert models[ALPHA]["default"] and sorted(models[ALPHA]["workers"]) == sorted(cluster.alpha)
    assert models[BETA]["workers"][: len(cluster.beta)] == cluster.beta


def test_per_model_metrics_count_requests_and_cached_tokens(cluster: Cluster) -> None:
    label = f'{{model="{BETA}"}}'
    before = _metric(cluster, "memserve_router_model_requests_total" + label)
    doc = _document()
    _send(cluster, doc + " a", BETA)
    _send(cluster, doc + " b", BETA)
    assert _metric(cluster, "memserve_router_model_requests_total" + label) == before + 2
    assert _metric(cluster, "memserve_router_model_cached_tokens_total" + label) > 200


def test_a_worker_added_with_model_id_serves_it_and_removal_works(cluster: Cluster) -> None:
    spare = cluster.spare.url
    status, body = call(cluster.router + "/workers", {"url": spare, "model_id": "gamma"})
    assert status == 400 and "gamma" in body["message"]
    status, body = call(cluster.router + "/workers", {"url": spare, "model_id": BETA})
    assert status == 200 and body["model_id"] == BETA
    old = cluster.beta[0]
    quoted = urllib.parse.quote(old, safe="")
    try:
        status, _ = call(cluster.router + f"/workers/{quoted}", method="DELETE")
        assert status == 200
        served, _, _ = _send(cluster, _document(10), BETA)
        assert served == spare  # the only beta worker left
        served, _, _ = _send(cluster, _document(10), ALPHA)
        assert served in cluster.alpha  # never the new beta worker
    finally:
        query = urllib.parse.urlencode({"url": old, "model_id": BETA})
        status, body = call(cluster.router + "/add_worker?" + query, method="POST")
        assert status == 200 and body["model_id"] == BETA


# ---------------------------------------------------------------- the file, the resolution


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[model]]\nname = 'a'\n\n[[model]]\nname = 'a'\n", "given twice"),
        ("[[model]]\nname = 'a:b'\n", "without ':'"),
        ("[[model]]\nname = 'a'\npolicy = 'nope'\n", "unknown policy"),
        ("[[model]]\nname = 'a'\ncolour = 1\n", "colour"),
        ("[[model]]\nname = 'a'\ntokenizer_path = '/nowhere'\n", "no tokenizer.json"),
        (
            "[[model]]\nname = 'a'\nworker_urls = ['http://h:1']\n"
            "[[model]]\nname = 'b'\nworker_urls = ['http://h:1']\n",
            "already under model 'a'",
        ),
        ("model = []\n", "no [[model]]"),
        ('{"model": [{"name": 3}]}', "Expected `str`"),
    ],
)
def test_a_bad_models_file_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^models\.toml: ") as caught:
        parse_models(text, "models.toml")
    assert says in str(caught.value)


def test_a_bad_models_file_is_a_clear_startup_error(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[[model]]\nname = 'a'\npolicy = 'nope'\n")
    run = run_module("router", ["--models", str(path)])
    assert run.returncode != 0
    assert run.stderr.strip().startswith(f"--models {path}: model[0] (a): unknown policy 'nope'"), (
        run.stderr
    )
    assert "Traceback" not in run.stderr


def test_a_request_names_its_model_by_base_and_each_model_keys_its_own_paths() -> None:
    models = Models(
        [ServedModel(ALPHA, RoundRobin(), None), ServedModel(BETA, RoundRobin(), None, BETA)]
    )
    assert models.resolve(None).name == ALPHA and models.resolve("default:x").name == ALPHA
    assert models.resolve("beta:some-adapter").name == BETA
    with pytest.raises(RequestError) as caught:
        models.resolve("gamma:beta")
    assert caught.value.status == 404
    ids = list(range(3 * PAGE))
    body = {"input_ids": ids}
    plain = route_request("/generate", body, None).tree_key(ids, PAGE)
    beta = route_request("/generate", body, None, model_key=BETA).tree_key(ids, PAGE)
    gamma = route_request("/generate", body, None, model_key="gamma").tree_key(ids, PAGE)
    assert list(plain) == ids
    assert list(beta[PAGE:]) == ids[PAGE:]  # the first page keyed by the model alone
    assert len({tuple(plain[:PAGE]), tuple(beta[:PAGE]), tuple(gamma[:PAGE])}) == 3
    adapter = {"input_ids": ids, "model": "beta:x"}
    keyed = route_request("/generate", adapter, None, model_key=BETA).tree_key(ids, PAGE)
    assert list(keyed[:PAGE]) != list(beta[:PAGE])  # an adapter of it: apart again


def test_a_workers_kv_events_are_keyed_by_its_model() -> None:
    """A worker of a model other than the default one publishes bare token ids; the trees
    hold them under that model's key (as its requests are keyed), never under the default
    model's, and a salted page under the model and the salt together."""
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add("http://127.0.0.1:9301")
    worker.model_id = BETA
    models = Models(
        [ServedModel(ALPHA, RoundRobin(), None), ServedModel(BETA, RoundRobin(), None, BETA)]
    )
    trees = PromptTrees(page_size=PAGE)
    applier = KVEventApplier(trees, registry)
    applier.model_key = lambda w: models.key_of(w.model_id)
    ids = list(range(500, 500 + 4 * PAGE))
    salted = BlockStoredMetadata(cache_salt="s", extra_key=None, lora_name=None)
    stored = [  # as the worker publishes them: two plain pages, then two salted ones
        BlockStored([1, 2], None, ids[: 2 * PAGE], PAGE, None),
        BlockStored([3, 4], 2, ids[2 * PAGE :], PAGE, None, None, salted),
    ]
    for event in stored:
        applier.apply(worker.url, KVEventBatch(0.0, [event]))
    C = WorkerType.COLOCATED
    body: dict[str, Any] = {"input_ids": ids}
    beta = route_request("/generate", body, None, model_key=BETA).tree_key(ids, PAGE)
    assert trees.match(C, beta).held == {worker.url: 2 * PAGE}  # its unsalted pages
    assert trees.match(C, ids).held == {}  # nothing under the default model
    body = {**body, "cache_salt": "s", "shared_prefix_tokens": 2 * PAGE}
    both = route_request("/generate", body, None, model_key=BETA).tree_key(ids, PAGE)
    assert trees.match(C, both).held == {worker.url: 4 * PAGE}
    applier.apply(worker.url, KVEventBatch(0.0, [BlockRemoved([4])]))
    assert trees.match(C, both).held == {worker.url: 3 * PAGE}
