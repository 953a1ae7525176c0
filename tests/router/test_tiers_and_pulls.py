"""The router's view of one KV pool across workers and tiers: what it prices, what it names."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from router.forward.dispatch import with_prefix_holders
from router.kv_events.listener import KVEventApplier
from router.policies import Cost, CostModel, Decision, PromptTree, RouteRequest, Thresholds
from router.trees import PromptTrees, Tier
from router.workers import Agent, BreakerConfig, Worker, WorkerRegistry, WorkerType
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, page_hashes
from shared.namespaces import CacheNamespace
from tests.http_client import call
from tests.procs import free_port, running

C = WorkerType.COLOCATED


def pulling_workers(n: int) -> list[Worker]:
    ws = [Worker(f"http://127.0.0.1:{9100 + i}") for i in range(n)]
    for i, w in enumerate(ws):
        w.agent = Agent(i + 1, "127.0.0.1", 7100 + i)
    return ws


def test_trees_tell_device_from_host_per_worker() -> None:
    trees = PromptTrees(page_size=4)
    tokens = list(range(32))
    trees.record(C, "a", tokens[:16])  # routed there: on device
    trees.record(C, "a", tokens[:32], Tier.HOST)  # its KV events: the tail went to host
    trees.record(C, "b", tokens[:8])
    view = trees.match(C, tokens)
    assert view.held == {"a": 32, "b": 8}
    assert view.device == {"a": 16, "b": 8}
    assert view.host("a") == 16 and view.host("b") == 0
    trees.drop(C, "a", tokens, keep_tokens=24, tier=Tier.HOST)  # host dropped pages 7, 8
    assert trees.match(C, tokens).held["a"] == 24
    trees.drop(C, "a", tokens, keep_tokens=8, tier=Tier.DEVICE)  # device pages 3, 4 moved
    view = trees.match(C, tokens)
    assert view.held["a"] == 24 and view.device["a"] == 8 and view.host("a") == 16
    trees.forget("a")  # a dead worker holds nothing in any tier
    assert "a" not in trees.match(C, tokens).held


def test_kv_event_media_name_tiers() -> None:
    assert Tier.of_medium(None) is Tier.DEVICE
    assert Tier.of_medium("GPU") is Tier.DEVICE
    assert Tier.of_medium("CPU_PINNED") is Tier.HOST
    assert Tier.of_medium("cpu") is Tier.HOST


def test_the_cost_model_prices_host_loads_and_pulls() -> None:
    cost = CostModel()
    a, b = pulling_workers(2)
    recompute = cost.plan(a, 20_000, 0)
    assert not recompute.pull and recompute.computed == 20_000
    # attention: 20K new tokens form 2e8 (new, context) pairs, 0.26 s beyond the 0.8 s linear
    assert recompute.seconds == pytest.approx(20_000 * 4e-5 + 20_000 * 10_000 * 1.3e-9)
    tail = cost.plan(a, 20_000, 16_000)  # the last 4K attend to the 16K before them too
    assert tail.seconds == pytest.approx(4_000 * 4e-5 + 4_000 * 18_000 * 1.3e-9)
    host = cost.plan(a, 20_000, 19_000, host=19_000)
    assert host.computed == 1_000
    assert host.seconds < recompute.seconds / 5  # loading from DRAM beats recomputing
    pull = cost.plan(a, 20_000, 0, source=b, best=19_000)
    assert pull.pull and pull.computed == 1_000 and pull.seconds < recompute.seconds / 4
    b.pulls_served = 7  # its link is shared by seven pulls already: 8x slower
    shared = cost.plan(a, 20_000, 0, source=b, best=19_000)
    assert shared.seconds > pull.seconds
    a.agent = None  # a real SGLang server: it cannot pull
    assert not cost.plan(a, 20_000, 0, source=b, best=19_000).pull


def test_an_overloaded_holder_hands_its_prefix_on_by_a_pull() -> None:
    """Work leaves a holder as often with pulls as without (the copy displaces other cache
    where it lands): behind one queued cold prompt (0.84 s) a 20K history stays; behind
    three (2.5 s) it moves, and with pulls the new worker is told whom to pull it from
    instead of recomputing it."""
    trees = PromptTrees(page_size=16)
    history = list(range(20_000))
    turn = RouteRequest(history + list(range(900_000, 900_120)), "", None)
    for pulls in (False, True):
        for queued, moves in ((1, False), (3, True)):
            ws = pulling_workers(3)
            trees.clear()
            trees.record(C, ws[0].url, history)
            ws[0].in_flight, ws[0].in_flight_tokens = queued, queued * 21_000
            ws[2].in_flight = 1
            d = PromptTree(trees, Thresholds(), CostModel(), pulls=pulls).select(turn, ws)
            if not moves:
                assert d.worker is ws[0] and d.reason == "cache_hit" and d.pull_from is None
            elif pulls:
                assert d.worker is ws[1] and d.reason == "overload_pull"
                assert d.pull_from is ws[0] and d.holders == [(ws[0], 20_000)]
            else:
                assert d.worker is ws[1] and d.reason == "overload" and d.holders == []


def test_a_namespaced_request_is_priced_a_pull_behind_a_public_prefix_only() -> None:
    """A request salted from its first token, under an extra_key or an adapter, that leaves
    an overloaded holder is planned as a recompute with no holders named; a salt after a
    public prefix is planned as a pull (router.policies.pull_limit says why: priced as
    pulls, one tenant's whole private prompt was copied wherever it waited less, and full
    isolation collapsed). A model's key, the router's own, leaves pulls alone."""
    trees = PromptTrees(page_size=16)
    history = list(range(20_000))
    tokens = history + list(range(900_000, 900_120))
    for namespace, pulls in (
        (CacheNamespace(cache_salt="tenant-a"), False),
        (CacheNamespace(extra_key="team-b"), False),
        (CacheNamespace.named("", "lora03", None, 0), False),
        (CacheNamespace.named("", "lora03", "tenant-a", 16_000), False),
        (CacheNamespace(cache_salt="t", shared_prefix_tokens=16_000), True),
        (CacheNamespace(model="beta"), True),
        (None, True),
    ):
        turn = RouteRequest(tokens, "", None, namespace=namespace)
        ws = pulling_workers(3)
        trees.clear()
        trees.record(C, ws[0].url, turn.tree_key(history, 16))
        ws[0].in_flight, ws[0].in_flight_tokens = 3, 63_000
        ws[2].in_flight = 1
        d = PromptTree(trees, Thresholds(), CostModel()).select(turn, ws)
        assert d.worker is ws[1], namespace
        if pulls:
            assert d.reason == "overload_pull" and d.pull_from is ws[0], namespace
        else:
            assert d.reason == "overload" and d.pull_from is None and d.holders == [], namespace


def test_a_host_hit_is_named_and_a_no_pull_router_never_names_holders() -> None:
    trees = PromptTrees(page_size=16)
    ws = pulling_workers(2)
    history = list(range(4_000))
    trees.record(C, ws[0].url, history[:1_024])
    trees.record(C, ws[0].url, history, Tier.HOST)
    turn = RouteRequest(history + list(range(50_000, 50_050)), "", None)
    d = PromptTree(trees, Thresholds(), CostModel()).select(turn, ws)
    assert d.worker is ws[0] and d.reason == "host_hit" and d.predicted_cached == 4_000
    ws[0].in_flight_tokens = 500_000  # 20 s of queued work there
    d = Cost(trees, Thresholds(), CostModel(), pulls=False).select(turn, ws)
    assert d.worker is ws[1] and d.holders == [] and d.reason == "cache_miss"
    d = Cost(trees, Thresholds(), CostModel()).select(turn, ws)
    assert d.worker is ws[1] and d.reason == "pull" and d.holders == [(ws[0], 4_000)]


def test_the_hint_names_each_holders_agent_and_leaves_plain_bodies_alone() -> None:
    ws = pulling_workers(2)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    raw = json.dumps(body).encode()
    assert with_prefix_holders(body, raw, Decision(ws[1])) is raw
    hinted = json.loads(with_prefix_holders(body, raw, Decision(ws[1], 0, [(ws[0], 512)])))
    assert hinted["text"] == "hi"
    assert hinted["memserve"]["prefix_holders"] == [
        {
            "url": ws[0].url,
            "cached_tokens": 512,
            "instance_id": 1,
            "host": "127.0.0.1",
            "port": 7100,
        }
    ]


def test_agents_are_learned_only_from_workers_that_serve_pulls() -> None:
    info = {"memserve": {"kv_pull": True, "agent": {"instance_id": 3, "host": "h", "port": 9}}}
    assert Agent.from_server_info(info) == Agent(3, "h", 9)
    assert Agent.from_server_info({"memserve": {"kv_pull": False, "agent": {}}}) is None
    assert Agent.from_server_info({"version": "0.5.23"}) is None  # a real SGLang server
    assert Agent.from_server_info(None) is None
    bad = {"memserve": {"kv_pull": True, "agent": {"instance_id": "3", "host": "h", "port": 9}}}
    assert Agent.from_server_info(bad) is None


def test_kv_events_move_a_workers_pages_between_its_tiers() -> None:
    """SGLang's events for a swap (removed from GPU, stored on CPU_PINNED), then a host drop."""
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add("http://127.0.0.1:9200")
    trees = PromptTrees(page_size=4)
    listener = KVEventApplier(trees, registry)
    tokens = list(range(16))
    hashes = page_hashes(tokens, 4)

    def send(*events: BlockStored | BlockRemoved) -> None:
        listener.apply(worker.url, KVEventBatch(0.0, list(events)))

    send(BlockStored(hashes, None, tokens, 4, None, "GPU"))
    assert trees.match(C, tokens).device == {worker.url: 16}
    send(
        BlockRemoved(hashes[2:], "GPU"),
        BlockStored(hashes[2:], hashes[1], tokens[8:], 4, None, "CPU_PINNED"),
    )
    view = trees.match(C, tokens)
    assert view.held[worker.url] == 16 and view.host(worker.url) == 8
    send(BlockRemoved(hashes[3:], "CPU_PINNED"))  # the host tier dropped the last page
    view = trees.match(C, tokens)
    assert view.held[worker.url] == 12 and view.device[worker.url] == 8
    send(BlockRemoved(hashes[:2]))  # no medium: the GPU, as SGLang without HiCache
    assert trees.match(C, tokens).held.get(worker.url, 0) == 0 or (
        trees.match(C, tokens).device.get(worker.url, 0) == 0
    )


def test_kv_events_tell_how_much_of_a_workers_device_kv_is_free() -> None:
    """Capacity (server info) less the device pages its events name; host pages do not
    count; unknown (-1) without a capacity, and again once its cache is forgotten."""
    registry = WorkerRegistry(BreakerConfig())
    worker = registry.add("http://127.0.0.1:9200")
    listener = KVEventApplier(PromptTrees(page_size=4), registry)
    tokens = list(range(16))
    hashes = page_hashes(tokens, 4)

    def send(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        listener.apply(worker.url, KVEventBatch(0.0, list(events)))

    send(BlockStored(hashes[:1], None, tokens[:4], 4, None, "GPU"))
    assert worker.free_tokens == -1  # no capacity known
    worker.kv_capacity = 40
    send(BlockStored(hashes[1:], hashes[0], tokens[4:], 4, None, "GPU"))
    assert worker.free_tokens == 40 - 16
    send(BlockStored(hashes[1:], hashes[0], tokens[4:], 4, None, "GPU"))  # told twice
    assert worker.free_tokens == 40 - 16
    send(
        BlockRemoved(hashes[2:], "GPU"),
        BlockStored(hashes[2:], hashes[1], tokens[8:], 4, None, "CPU_PINNED"),
    )
    assert worker.free_tokens == 40 - 8  # swapped out to the host
    send(BlockRemoved(hashes[:2]))
    assert worker.free_tokens == 40
    send(BlockStored(hashes, None, tokens, 4, None, "GPU"), AllBlocksCleared())
    assert worker.free_tokens == 40
    send(BlockStored(hashes, None, tokens, 4, None, "GPU"))
    listener.forget(worker.url)
    assert worker.free_tokens == -1


def test_the_router_routes_to_a_host_tier_hit_it_heard_of(model_dir: Path, tmp_path: Path) -> None:
    """A worker with a GPU KV of 1,024 tokens and a host tier: a long history pushed to the
    host by other traffic is still found there (KV events with the medium tell the router),
    and the answer reports it as a host hit."""
    events_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": url}
    worker = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    worker += ["--max-total-tokens", "1024", "--enable-hierarchical-cache", "--hicache-ratio", "8"]
    worker += ["--kv-events-config", json.dumps(config)]
    router = ["--policy", "prompt_tree", "--worker-urls", url]
    router += ["--kv-events-bind", f"tcp://127.0.0.1:{events_port}"]
    with (
        running("connector.worker", worker, tmp_path, port=port),
        running("router", router, tmp_path) as r,
    ):
        history = list(range(1000, 1600))
        one = {"max_new_tokens": 1}
        # Until the router's subscription has formed (a page chain it never heard of cannot
        # be followed between tiers), then the history, heard whole.
        deadline = time.monotonic() + 20
        warm = 9000
        while kv_batches(r.url) == 0 and time.monotonic() < deadline:
            warm += 40  # two pages nobody else uses
            call(
                r.url + "/generate",
                {"input_ids": list(range(warm, warm + 40)), "sampling_params": one},
            )
            time.sleep(0.2)
        call(r.url + "/generate", {"input_ids": history, "sampling_params": one})
        events_settle(r.url)
        for k in range(3):  # other prompts push the history out to the host tier
            other = list(range(5000 + 700 * k, 5600 + 700 * k))
            call(r.url + "/generate", {"input_ids": other, "sampling_params": one})
        events_settle(r.url)
        turn = {"input_ids": history + [7, 8, 9], "sampling_params": one}
        status, answer = call(r.url + "/generate", turn)
        assert status == 200
        assert answer["meta_info"]["cached_tokens_details"]["host"] > 0
        assert reasons(r.url).get("host_hit", 0) >= 1
        (listed,) = call(r.url + "/workers")[1]["workers"]
        assert listed["kv_capacity_tokens"] == 1024  # its server info
        # its events: the GPU filled by the last prompts (the answers' pages included)
        assert listed["kv_free_tokens"] is not None and 0 <= listed["kv_free_tokens"] < 1024 - 512


def kv_batches(router_url: str) -> int:
    return int(call(router_url + "/get_server_info")[1]["kv_events"]["batches"])


def events_settle(router_url: str, quiet_s: float = 0.5, timeout_s: float = 10.0) -> None:
    """Wait until the router has heard no new KV-event batch for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        batches = kv_batches(router_url)
        if batches != last:
            last, since = batches, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def reasons(router_url: str) -> dict[str, float]:
    """sgl_router_load_balancing_events by reason, from the router's /metrics."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sgl_router_load_balancing_events_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_with_kv_events_only_the_events_say_what_an_answer_left_cached() -> None:
    """Recording the answer as well could re-add pages the worker's events already removed
    (a full cache evicts within steps): phantom holders until the TTL."""

    from router.forward.feedback import Learner, Served
    from router.forward.relay import Outcome
    from router.metrics import RouterMetrics

    for exact, recorded in ((False, True), (True, False)):
        registry = WorkerRegistry(BreakerConfig())
        worker = registry.add("http://127.0.0.1:9300")
        trees = PromptTrees(page_size=4)
        learner = Learner(
            trees, registry, RouterMetrics(registry, trees), None, True, lambda: True, exact
        )
        prompt = RouteRequest(list(range(32)), "", None)
        answer = Outcome(status=200, output_ids=list(range(100, 108)))
        served = [Served(worker, C, 0, 0)]
        learner.learn("/generate", prompt, answer, served, [(C, worker)])
        assert (trees.match(C, list(range(32)) + list(range(100, 108))).held != {}) is recorded
