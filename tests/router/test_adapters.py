"""LoRA adapters in the routing decision: a request for an adapter goes where it is loaded,
unless waiting there costs more than loading it elsewhere (router.adapters)."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.adapters import WorkerAdapters
from router.policies import (
    CostModel,
    LoraAffinity,
    PromptTree,
    RouteRequest,
    Thresholds,
    make_policy,
)
from router.trees import PromptTrees
from router.workers import Worker, WorkerType
from shared.namespaces import CacheNamespace
from tests.http_client import call, metric
from tests.procs import running

LOAD_S = 0.05


def test_a_loaded_adapter_costs_nothing_a_free_slot_one_load_a_full_worker_two() -> None:
    w = WorkerAdapters(capacity=2)
    assert w.seconds("a", LOAD_S) == LOAD_S
    w.sent("a")
    assert w.seconds("a", LOAD_S) == 0.0
    assert w.seconds("b", LOAD_S) == LOAD_S
    w.sent("b")
    assert w.seconds("c", LOAD_S) == 2 * LOAD_S  # it evicts one, loaded again later
    w.sent("a")  # used again: "b" is now the least recently used
    w.sent("c")
    assert list(w.resident) == ["a", "c"]
    assert WorkerAdapters().seconds("a", LOAD_S) == LOAD_S  # no limit known: a load


def test_a_full_worker_whose_adapters_are_all_in_use_prices_the_wait_for_one() -> None:
    """The engine evicts only an adapter no running request uses: with every slot in use, a
    request for another adapter waits for the least used one's requests to end."""
    w = WorkerAdapters(capacity=2)
    w.sent("a")
    w.sent("b")
    with w.serving("a"), w.serving("a"), w.serving("b"):
        assert w.seconds("c", LOAD_S) == 2 * LOAD_S  # no hold measured yet: a load only
        w.hold_s = 1.0
        assert w.seconds("c", LOAD_S) == pytest.approx(2 * LOAD_S + 0.5)  # b's one request
        assert w.seconds("a", LOAD_S) == 0.0  # loaded: no wait
        assert w.in_use == {"a": 2, "b": 1}
    assert w.in_use == {}
    assert w.seconds("c", LOAD_S) == 2 * LOAD_S  # every adapter idle again: a load and an evict
    assert w.hold_s is not None and 0.0 < w.hold_s < 1.0  # learned from the three requests
    learned = w.hold_s
    with pytest.raises(ConnectionError), w.serving("a"):
        raise ConnectionError("refused")  # a failure is no hold: nothing learned
    assert (w.hold_s, w.in_use) == (learned, {})
    pinned = WorkerAdapters(capacity=2, pinned={"a"})
    pinned.sent("a")
    pinned.sent("b")
    pinned.hold_s = 1.0
    with pinned.serving("b"):  # the pinned one idle is no help: it is never evicted
        assert pinned.seconds("c", LOAD_S) == pytest.approx(2 * LOAD_S + 0.5)


def test_a_request_pays_its_own_load_and_wait_not_the_evicted_adapters_next_load() -> None:
    w = WorkerAdapters(capacity=1)
    assert w.paid_s("a", LOAD_S) == LOAD_S  # a free slot: the load is all of it
    w.sent("a")
    assert w.paid_s("a", LOAD_S) == 0.0
    assert w.seconds("b", LOAD_S) == 2 * LOAD_S
    assert w.paid_s("b", LOAD_S) == LOAD_S  # the evicted a's reload is a later request's
    w.hold_s = 1.0
    with w.serving("a"):  # and the wait for a to be done is this request's own
        assert w.paid_s("b", LOAD_S) == pytest.approx(LOAD_S + 0.5)


def test_the_speed_fit_subtracts_only_what_the_request_waits_for() -> None:
    """The decision prices an evicting load twice (its load and the evicted adapter's
    next); the measured TTFT holds one, so the fit's fixed part is one load."""
    policy, a, b = _one_slot_pair()
    a.adapters.sent("alpha")
    b.adapters.sent("beta")
    d = policy.select(_request("gamma"), [a, b])
    assert d.work is not None and d.work.fixed_s == pytest.approx(LOAD_S)
    d = policy.select(_request("gamma"), [a, b])  # loaded where the first one went
    assert d.work is not None and d.work.fixed_s == 0.0


def test_a_queued_adapter_load_delays_the_requests_behind_it_until_its_first_byte() -> None:
    """The engine loads an adapter in the step that prefills its request: a request queued
    behind that one waits for the load too, so the next cold request goes to the other
    worker, and once the first byte came the load is no longer ahead of anyone."""
    policy, a, b = _one_slot_pair()
    cost = policy.cost
    first = policy.select(_request("alpha"), [a, b])
    assert first.worker is a and first.load_s == LOAD_S  # a free slot: one load
    b.in_flight_tokens = 500  # 20 ms of queued prefill on b, against the 50 ms load on a
    with a.request(0, True, first.load_s) as flight:
        running = cost.busy_s_per_request  # its share of the steps it runs in
        assert cost.queue_s(a) == pytest.approx(LOAD_S + running)
        assert policy.select(_request(None), [a, b]).worker is b
        flight.prefill_done()
        assert cost.queue_s(a) == pytest.approx(running) and a.in_flight_fixed_s == 0.0
        assert policy.select(_request(None), [a, b]).worker is a
    again = policy.select(_request("alpha"), [a, b])
    assert again.worker is a and again.load_s == 0.0  # loaded now: nothing to wait for
    with a.request(0, True, 0.3):
        pass  # ended before its first byte (a failure, a whole answer): nothing left queued
    assert a.in_flight_fixed_s == 0.0 and a.in_flight == 0


def test_the_adapter_in_use_is_not_the_one_counted_out() -> None:
    w = WorkerAdapters(capacity=2)
    w.sent("a")
    w.sent("b")  # a is the least recently used, but in use: b goes
    with w.serving("a"):
        w.sent("c")
    assert list(w.resident) == ["a", "c"]
    w.sent("d")  # none in use: the least recently used
    assert list(w.resident) == ["c", "d"]


def _one_slot_pair() -> tuple[PromptTree, Worker, Worker]:
    """The prompt_tree policy and two workers holding one adapter each at most."""
    policy = PromptTree(PromptTrees(page_size=16), Thresholds(), CostModel(lora_load_s=LOAD_S))
    a, b = Worker("http://127.0.0.1:9501"), Worker("http://127.0.0.1:9502")
    for w in (a, b):
        w.adapters.capacity = 1
    return policy, a, b


def test_the_policy_leaves_a_worker_whose_adapter_slots_are_all_busy() -> None:
    policy, a, b = _one_slot_pair()
    for w in (a, b):
        w.adapters.hold_s = 2.0  # a request holds its adapter 2 s
    a.adapters.sent("alpha")
    b.adapters.sent("beta")
    b.in_flight_tokens = 10_000  # 0.4 s of queued prefill on b
    assert policy.select(_request("gamma"), [a, b]).worker is a  # a's alpha is idle
    a.adapters.sent("alpha")
    with a.adapters.serving("alpha"):  # a's only slot is busy for ~1 s more
        assert policy.select(_request("delta"), [a, b]).worker is b


def test_pinned_adapters_are_never_counted_out() -> None:
    w = WorkerAdapters(capacity=1, pinned={"keep"})
    w.sent("keep")
    w.sent("other")
    assert list(w.resident) == ["keep", "other"]  # as the engine keeps a pinned one


def test_adapters_learned_from_ours_and_sglangs_server_info() -> None:
    ours = WorkerAdapters()
    ours.learn(
        {
            "lora": {
                "max_loaded_loras": 2,
                "adapters": [
                    {"lora_name": "a", "resident": True, "pinned": True},
                    {"lora_name": "b", "resident": False, "pinned": False},
                ],
            }
        }
    )
    assert (list(ours.resident), ours.pinned, ours.capacity) == (["a"], {"a"}, 2)
    theirs = WorkerAdapters()
    theirs.learn({"lora_paths": ["x=/p/x", {"lora_name": "y"}, "z"], "max_loaded_loras": 2})
    assert (list(theirs.resident), theirs.capacity) == (["x", "y"], 2)
    mapping = WorkerAdapters()
    mapping.learn({"lora_paths": {"m": "/p/m"}, "max_loaded_loras": None})
    assert (list(mapping.resident), mapping.capacity) == (["m"], None)
    garbage = WorkerAdapters()
    garbage.learn({"lora": {"adapters": "none", "max_loaded_loras": True}})
    assert (list(garbage.resident), garbage.capacity) == ([], None)


def _request(adapter: str | None) -> RouteRequest:
    ns = None if adapter is None else CacheNamespace(lora_id=adapter, lora_name=adapter)
    return RouteRequest(list(range(64)), "", None, namespace=ns)


def test_the_policy_prefers_the_worker_holding_the_adapter() -> None:
    policy, a, b = _one_slot_pair()
    b.adapters.sent("beta")
    assert policy.select(_request("beta"), [a, b]).worker is b
    assert policy.select(_request("alpha"), [a, b]).worker is a  # a free slot beats an evict
    assert list(a.adapters.resident) == ["alpha"]
    b.in_flight_tokens = 10_000  # 0.4 s of queued prefill: loading elsewhere is sooner
    assert policy.select(_request("beta"), [a, b]).worker is a
    d = policy.select(_request(None), [a, b])  # no adapter: nothing changes
    assert d.worker is a and d.work is not None and d.work.fixed_s == 0.0


def test_a_load_elsewhere_is_priced_for_the_requests_waiting_behind_it() -> None:
    """The engine loads an adapter in the step that prefills the request, holding up every
    request waiting there too: a load on `a` starts this request 30 ms sooner than `b`'s
    queue, but not when three requests wait on `a` (3 x 50 ms more)."""
    policy, a, b = _one_slot_pair()
    request = _request("beta")
    history = list(range(48))  # held by both: the choice is between their queues
    for w in (a, b):
        w.adapters.capacity = 2
        policy.trees.record(WorkerType.COLOCATED, w.url, request.tree_key(history, 16))
        w.in_flight = 3
    b.adapters.sent("beta")
    b.in_flight_tokens = 2_000  # 80 ms of queued prefill on b, against a's 50 ms load
    assert policy.select(request, [a, b]).worker is a  # running, none waiting
    a.adapters.resident.clear()
    for w in (a, b):
        w.unstarted = 3  # all three waiting
    assert policy.select(request, [a, b]).worker is b


def test_a_wait_for_an_adapter_slot_holds_up_no_one_but_its_request() -> None:
    """Where every adapter slot is in use, a request waits for one while the engine runs the
    requests behind it (SGLang skips it): of its price, only the load holds those up. Charged
    once per request waiting there, such a wait (seconds in a cold start) sent a hot
    adapter's requests to its one holder whatever that one's queue (the LoRA preset)."""
    policy, a, b = _one_slot_pair()
    request = _request("beta")
    history = list(range(48))  # held by both: the choice is between their queues
    for w in (a, b):
        policy.trees.record(WorkerType.COLOCATED, w.url, request.tree_key(history, 16))
        w.in_flight = w.unstarted = 3  # three waiting on each
    a.adapters.hold_s = 0.2
    a.adapters.sent("alpha")
    b.adapters.capacity = 2
    b.adapters.sent("beta")
    b.in_flight_tokens = 12_500  # 0.5 s of queued prefill on b
    with a.adapters.serving("alpha"):  # a's one slot is busy: beta waits 0.1 s, then loads
        assert a.adapters.seconds("beta", LOAD_S) == pytest.approx(0.1 + 2 * LOAD_S)
        assert a.adapters.stall_s("beta", LOAD_S) == LOAD_S
        # a: 0.2 s for itself and 3 x 50 ms for those waiting, against b's 0.5 s queue
        decision = policy.select(request, [a, b])
    assert decision.worker is a and decision.load_s == LOAD_S


def test_lora_affinity_scores_loaded_then_free_slot_then_evict_ties_by_load() -> None:
    """llm-d's scorer: 1.0 loaded, 0.8 a free slot, 0 a load that evicts; prefix-blind."""
    assert WorkerAdapters(OrderedDict(a=None), capacity=2).affinity("a") == 1.0
    assert WorkerAdapters(OrderedDict(a=None), capacity=2).affinity("b") == 0.8
    assert WorkerAdapters(capacity=None).affinity("b") == 0.8  # no known limit: a free slot
    assert WorkerAdapters(OrderedDict(a=None, c=None), capacity=2).affinity("b") == 0.0
    trees = PromptTrees(page_size=16)
    policy = make_policy("lora-affinity", trees, Thresholds(), CostModel())
    assert isinstance(policy, LoraAffinity)
    a, b, c = (Worker(f"http://127.0.0.1:950{i}") for i in (1, 2, 3))
    for w in (a, b, c):
        w.adapters.capacity = 1
    a.adapters.sent("alpha")
    b.adapters.sent("beta")
    a.in_flight_tokens = b.in_flight_tokens = 50_000  # a long queue does not move it
    a.in_flight = 9
    d = policy.select(_request("alpha"), [a, b, c])
    assert (d.worker, d.reason) == (a, "adapter_loaded")
    d = policy.select(_request("gamma"), [a, b, c])  # the free slot
    assert (d.worker, d.reason) == (c, "adapter_slot")
    assert list(c.adapters.resident) == ["gamma"]
    d = policy.select(_request("delta"), [a, b, c])  # all full: the least loaded evicts
    assert d.reason == "adapter_evict" and d.worker is not a
    assert policy.select(_request(None), [a, b, c]).reason == "no_adapter"


# ----------------------------------------------------------------- over loopback


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[list[str]]:
    root = tmp_path_factory.mktemp("adapters")
    worker = [
        *("--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"),
        *("--lora-paths", "alpha=/adapters/alpha", "beta=/adapters/beta"),
        *("--max-loaded-loras", "1", "--max-loras-per-batch", "1"),
    ]
    with (
        running("connector.worker", [*worker, "--instance-id", "1"], root) as w1,
        running("connector.worker", [*worker, "--instance-id", "2"], root) as w2,
        running("router", ["--policy", "prompt_tree", "--worker-urls", w1.url, w2.url], root) as r,
    ):
        yield [r.url, w1.url, w2.url]


def _loads(worker: str) -> int:
    status, info = call(worker + "/get_server_info")
    assert status == 200
    return int(info["lora"]["loads"])


def test_requests_for_two_adapters_keep_to_two_workers(cluster: list[str]) -> None:
    """Each worker holds one adapter: alternating requests for two adapters would load one on
    every request if sent to either worker alike; by placement, each adapter is loaded once."""
    router, *workers = cluster
    before = sum(_loads(w) for w in workers)
    for i in range(12):
        body: dict[str, Any] = {
            "model": "default:" + ("alpha", "beta")[i % 2],
            "prompt": f"{uuid.uuid4().hex} question {i}",
            "max_tokens": 2,
        }
        status, answer = call(router + "/v1/completions", body)
        assert status == 200, answer
    assert sum(_loads(w) for w in workers) - before <= 2
    status, listed = call(router + "/workers")
    assert status == 200
    seen = [w["lora"] for w in listed["workers"]]
    assert sorted(a for lora in seen for a in lora["loaded"]) == ["alpha", "beta"]
    assert all(lora["max_loaded_loras"] == 1 and lora["in_flight"] == {} for lora in seen)
    assert all(lora["hold_s"] > 0 for lora in seen)  # each served its adapter's requests
    status, text = call(router + "/metrics")
    assert status == 200
    for adapter in ("alpha", "beta"):
        labels = f'{{adapter="{adapter}",tenant="none"}}'
        assert metric(text, "memserve_router_group_requests_total" + labels) == 6
        assert metric(text, "memserve_router_group_prompt_tokens_total" + labels) > 0


def test_an_unknown_adapter_is_the_workers_400(cluster: list[str]) -> None:
    router = cluster[0]
    body = {"model": "default:nope", "prompt": "hi", "max_tokens": 2}
    status, answer = call(router + "/v1/completions", body)
    assert status == 400 and "nope" in answer["message"], answer
