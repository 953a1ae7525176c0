"""Which holders a PD prefill is told about: other prefills (the prefill policy's) and, with
PD-Caching-2/3, the decodes whose caches hold a longer prefix of the prompt."""

from __future__ import annotations

from typing import Any

import pytest

from router.forward.dispatch import Sender
from router.forward.feedback import Learner
from router.pd.strategy import PDSettings, PrefillDecode
from router.policies import Decision, RoundRobin, RouteRequest
from router.trees import PromptTrees
from router.workers import Agent, BreakerConfig, Worker, WorkerRegistry, WorkerType
from shared.pd_caching import Caching

P, D = WorkerType.PREFILL, WorkerType.DECODE


def cluster(caching: str, pulls: bool = True) -> tuple[PrefillDecode, list[Worker], PromptTrees]:
    """Two prefills that pull, two decodes that only serve (their agents say so)."""
    registry = WorkerRegistry(BreakerConfig())
    prefills = [registry.add(f"http://127.0.0.1:{9200 + i}", P, 8990 + i) for i in range(2)]
    decodes = [registry.add(f"http://127.0.0.1:{9300 + i}", D) for i in range(2)]
    for i, w in enumerate(prefills):
        w.agent = Agent(10 + i, "127.0.0.1", 7200 + i)
    for i, w in enumerate(decodes):
        w.agent = Agent(20 + i, "127.0.0.1", 7300 + i, pulls=False)
    trees = PromptTrees(page_size=16)
    learner: Any = Learner(trees, registry, None, None, True, bool)  # type: ignore[arg-type]
    sender: Any = Sender(None, learner, None, 30.0)  # type: ignore[arg-type]
    settings = PDSettings(Caching.parse(caching), RoundRobin(), RoundRobin(), pulls)
    return PrefillDecode(settings, registry, sender), prefills + decodes, trees


def test_decodes_that_cache_a_longer_prefix_are_named_to_a_prefill_that_pulls() -> None:
    pd, (p0, p1, d0, d1), trees = cluster("caching-3")
    history = list(range(1_000, 3_000))
    trees.record(D, d1.url, history)
    trees.record(D, d0.url, history[:512])
    trees.record(P, p0.url, history[:1_024])
    turn = RouteRequest(history + list(range(50_000, 50_040)), "", None)
    # p1 chosen with nothing held; the prefill policy named p0 (1,024 tokens)
    decision = Decision(p1, 0, [(p0, 1_024)], "overload")
    assert pd.prefill_holders(turn, decision) == [(d1, 2_000), (p0, 1_024), (d0, 512)]
    # a decode holding no more than the chosen prefill is not named
    assert pd.prefill_holders(turn, Decision(p1, 1_024)) == [(d1, 2_000)]
    assert not d0.can_pull and p1.can_pull  # decodes serve pulls, they do not pull


@pytest.mark.parametrize(
    ("caching", "pulls", "agentless"),
    [("caching-1", True, False), ("caching-3", False, False), ("caching-3", True, True)],
)
def test_no_decode_is_named_where_it_caches_nothing_pulls_are_off_or_the_prefill_cannot_pull(
    caching: str, pulls: bool, agentless: bool
) -> None:
    pd, (p0, p1, d0, _), trees = cluster(caching, pulls)
    if agentless:  # a real SGLang prefill: no agent, no pulls
        p1.agent = None
    history = list(range(2_000))
    trees.record(D, d0.url, history)
    turn = RouteRequest(history + [7, 8, 9], "", None)
    assert pd.prefill_holders(turn, Decision(p1, 0, [(p0, 512)])) == [(p0, 512)]


def test_a_decode_agent_is_learned_from_serves_pulls_without_kv_pull() -> None:
    where = {"instance_id": 3, "host": "127.0.0.1", "port": 7001}
    memserve: dict[str, Any] = {"kv_pull": False, "serves_pulls": True, "agent": where}
    assert Agent.from_server_info({"memserve": memserve}) == Agent(3, "127.0.0.1", 7001, False)
    memserve["serves_pulls"] = False
    assert Agent.from_server_info({"memserve": memserve}) is None  # neither pulls nor serves


def test_while_requests_wait_for_a_slot_each_side_goes_to_an_idle_worker() -> None:
    """PD narrows both sides as a colocated router does (WorkerRegistry.idle_first): with
    requests queued for a slot, the busy prefill and the busy decode are passed over."""
    pd, (p0, p1, d0, d1), _ = cluster("caching-1")
    p0.state.in_flight = d0.state.in_flight = 1
    turn = RouteRequest(list(range(100)), "", None)
    alone = set()
    for _ in range(2):  # round robin alone takes turns over the busy ones too
        picked = pd.pick(turn, set())
        assert picked is not None
        alone |= {picked[0].worker.url, picked[1].worker.url}
    assert {p0.url, d0.url} <= alone
    pd.registry.backlogged = lambda: True
    for _ in range(3):
        picked = pd.pick(turn, set())
        assert picked is not None
        prefill, decode = picked
        assert (prefill.worker, decode.worker) == (p1, d1)
        assert prefill.reason == decode.reason == "idle"
