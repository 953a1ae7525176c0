"""The router's view of one KV pool across workers and tiers: what it prices, what it names."""

from __future__ import annotations

import json

from router.dispatch import with_prefix_holders
from router.policies import Cost, CostModel, Decision, PromptTree, RouteRequest, Thresholds
from router.trees import PromptTrees, Tier
from router.workers import Agent, Worker, WorkerType

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
    """Behind one queued cold prompt (0.84 s), a 20K history would leave its holder only if
    another worker recomputed it (0.8 s of work in front of the others: not worth it); with
    pulls, the history moves for 0.1 s of transfer, and the new worker is told whom to pull
    from."""
    trees = PromptTrees(page_size=16)
    history = list(range(20_000))
    turn = RouteRequest(history + list(range(900_000, 900_120)), "", None)
    for pulls, where, reason in ((False, 0, "cache_hit"), (True, 1, "overload_pull")):
        ws = pulling_workers(3)
        trees.clear()
        trees.record(C, ws[0].url, history)
        ws[0].in_flight, ws[0].in_flight_tokens = 1, 21_000
        ws[2].in_flight = 1
        d = PromptTree(trees, Thresholds(), CostModel(), pulls=pulls).select(turn, ws)
        assert d.worker is ws[where] and d.reason == reason
        if pulls:
            assert d.pull_from is ws[0] and d.holders == [(ws[0], 20_000)]
            assert d.predicted_cached == 0
        else:
            assert d.pull_from is None and d.holders == []


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
