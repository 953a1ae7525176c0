"""The native decision against the Python reference model (tests/router/policy_model.py):
the same trees, workers and requests give the same choice, reason, prediction, holders, pull
and priced work; bad input raises a clear Python exception."""

from __future__ import annotations

import math
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempool._radix import Decider, Heat, WorkerState
from mempool.errors import InvalidRequest
from router.policies import Cost, CostModel, PromptTree, RouteRequest, Thresholds
from router.trees import PromptTrees, Tier
from router.workers import Agent, Worker, WorkerType
from shared.namespaces import CacheNamespace
from tests.router.policy_model import PrefixHeat, ReferencePolicy

PAGE = 4
FUTURE = 1e12  # finish times ahead of any clock: a service rate that does not move with now


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)
worker_st = st.fixed_dictionaries(
    {
        "prefill": st.booleans(),
        "in_flight": st.integers(0, 6),
        "in_flight_tokens": st.integers(0, 20_000),
        "peer_in_flight": st.integers(0, 3),
        "reported_reqs": st.integers(0, 6),
        "reported_waiting": st.integers(0, 3),
        "reported_pending_tokens": st.integers(0, 20_000),
        "unstarted": st.integers(0, 3),
        "pulls_served": st.integers(0, 2),
        "agent": st.sampled_from([None, True, True, False]),  # None, pulls, serves only
        "finished": st.integers(0, 8),
        "free_tokens": st.one_of(st.just(-1), st.integers(0, 48)),  # -1: not known
        "in_flight_fixed_s": st.sampled_from([0.0, 0.0, 0.05, 0.4]),  # adapter loads queued
        # LoRA adapters loaded (router.adapters) and how many it holds (None: not known)
        "adapters": st.tuples(st.sets(st.sampled_from("ab")), st.sampled_from([None, 1, 2])),
        "x": st.tuples(*[st.floats(0.2, 5.0)] * 3, st.floats(0.0, 0.05), st.floats(0.2, 5.0)),
    }
)


def make_worker(i: int, spec: dict) -> Worker:
    kind = WorkerType.PREFILL if spec["prefill"] else WorkerType.COLOCATED
    w = Worker(f"http://127.0.0.1:{9000 + i}", kind)
    for name in (
        "in_flight",
        "in_flight_tokens",
        "peer_in_flight",
        "reported_reqs",
        "reported_waiting",
        "reported_pending_tokens",
        "unstarted",
        "pulls_served",
        "free_tokens",
        "in_flight_fixed_s",
    ):
        setattr(w, name, spec[name])
    if spec["agent"] is not None:
        w.agent = Agent(i + 1, "127.0.0.1", 7000 + i, pulls=spec["agent"])
    for k in range(spec["finished"]):
        w.state.finish(FUTURE + k * 0.25)
    speed = w.speed
    speed.queue_x, speed.token_x, speed.pair_x, speed.overhead_s, speed.transfer_x = spec["x"]
    loaded, w.adapters.capacity = spec["adapters"]
    for name in sorted(loaded):
        w.adapters.sent(name)
    return w


def same(a, b) -> None:
    assert (a.worker.url, a.reason, a.predicted_cached) == (
        b.worker.url,
        b.reason,
        b.predicted_cached,
    )
    assert [(w.url, n) for w, n in a.holders] == [(w.url, n) for w, n in b.holders]
    assert (a.pull_from and a.pull_from.url) == (b.pull_from and b.pull_from.url)
    assert a.work == pytest.approx(b.work, rel=1e-9, abs=1e-15)
    assert a.load_s == b.load_s


doc_st = st.lists(st.integers(0, 1000), min_size=8, max_size=48)


@settings(max_examples=300, deadline=None)
@given(
    rule=st.sampled_from(["prompt_tree", "cost"]),
    specs=st.lists(worker_st, min_size=1, max_size=5),
    docs=st.lists(doc_st, min_size=1, max_size=3),  # prefixes the requests share
    held=st.lists(
        st.tuples(
            st.integers(0, 4), st.sampled_from(list(Tier)), st.integers(0, 2), st.integers(1, 48)
        ),
        max_size=12,
    ),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 48),
            st.lists(st.integers(0, 3), max_size=40),  # none: a prompt all in `rest`
            st.integers(0, 9),
            st.sampled_from([0.0, 0.5, 30.0]),
            # a LoRA adapter, or a tenant's salt after a public prefix of so many tokens
            st.sampled_from([None, None, "a", "b", "c", "salt:0", "salt:8", "salt:20"]),
        ),
        min_size=1,
        max_size=12,
    ),
    pulls=st.booleans(),
    balance=st.tuples(st.sampled_from([0, 4, 64]), st.floats(1.0, 2.0)),
)
def test_the_native_decision_is_the_reference_models(
    rule,
    specs,
    docs,
    held,
    requests,
    pulls,
    balance,
) -> None:
    clock = Clock()
    trees = PromptTrees(page_size=PAGE, ttl_s=1e9, clock=clock)
    ws = [make_worker(i, s) for i, s in enumerate(specs)]
    for i, tier, doc, cut in held:
        tokens = docs[doc % len(docs)][:cut]
        trees.record(WorkerType.COLOCATED, f"http://127.0.0.1:{9000 + i}", tokens, tier)
    thresholds = Thresholds(balance_abs=balance[0], balance_rel=balance[1])
    cost = CostModel()
    native = (PromptTree if rule == "prompt_tree" else Cost)(trees, thresholds, cost, pulls)
    heat_clock = Clock()
    if rule == "prompt_tree":
        native.heat = Heat(PAGE, clock=heat_clock)
    model = ReferencePolicy(
        rule, trees, thresholds, cost, pulls, PrefixHeat(PAGE, clock=heat_clock)
    )
    for doc, cut, suffix, rest, later, adapter in requests:
        heat_clock.now += later
        tokens = docs[doc % len(docs)][:cut] + suffix
        ns = namespace(adapter)
        # the model first: the native policy then notes the adapter as loaded where it chose
        expected = model.select(RouteRequest(tokens, "", None, rest_tokens=rest, namespace=ns), ws)
        request = RouteRequest(array("I", tokens), "", None, rest_tokens=rest, namespace=ns)
        same(native.select(request, ws), expected)
        if ns is not None and ns.lora_name is not None:
            assert adapter in expected.worker.adapters.resident


def namespace(name: str | None) -> CacheNamespace | None:
    """`a`: that LoRA adapter's; `salt:N`: a tenant's salt after N public tokens."""
    if name is None:
        return None
    if name.startswith("salt:"):
        return CacheNamespace(cache_salt="tenant", shared_prefix_tokens=int(name[5:]))
    return CacheNamespace(lora_id=name, lora_name=name)


def test_a_hot_prefix_is_counted_alike() -> None:
    clock = Clock()
    heat, model = Heat(PAGE, half_life_s=10.0, clock=clock), PrefixHeat(PAGE, 10.0, clock=clock)
    tokens = list(range(40))
    for length, later in ((3, 0), (16, 0), (16, 1), (20, 0), (16, 10), (16, 0)):
        clock.now += later
        assert heat.bump(array("I", tokens), length) == pytest.approx(model.bump(tokens, length))
        assert heat.before == pytest.approx(model.before)
    assert len(heat) == 2  # (16, last page) and (20, last page)


def test_heat_keeps_at_most_its_entries() -> None:
    heat = Heat(PAGE, max_entries=3, clock=Clock())
    for length in (4, 8, 12, 16):
        heat.bump(list(range(16)), length)
    assert len(heat) == 3
    assert heat.bump(list(range(16)), 4) == 0.0  # the least recently seen went


def test_bad_input_raises_a_clear_error() -> None:
    trees = PromptTrees(page_size=PAGE)
    core = CostModel().decider("prompt_tree", PAGE)
    tree = trees.trees[WorkerType.COLOCATED]
    state = WorkerState("http://a:1")
    with pytest.raises(ValueError, match="at least one worker"):
        core.decide(tree, [1, 2, 3, 4], 4, [])
    with pytest.raises(TypeError, match="WorkerState"):
        core.decide(tree, [1, 2, 3, 4], 4, ["http://a:1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="num_tokens"):
        core.decide(tree, [1, 2, 3, 4], -1, [state])
    with pytest.raises(ValueError, match="page size"):
        CostModel().decider("cost", 8).decide(tree, [1] * 8, 8, [state])
    with pytest.raises(TypeError, match="RadixTree"):
        core.decide(object(), [1], 1, [state])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"one .* entry per worker"):
        core.decide_view([], [1], 1, [state])
    with pytest.raises(ValueError, match="rule"):
        CostModel().decider("round_robin")
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        CostModel(prefill_s_per_token=-1.0).decider("cost")
    with pytest.raises(ValueError, match="half_life_s"):
        Heat(PAGE, half_life_s=0.0)
    with pytest.raises(TypeError, match="Heat"):
        core.heat = "hot"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="url"):
        WorkerState(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="token ids"):
        core.decide(tree, [1, -2, 3, 4], 4, [state])
    for before, error in (
        ([0.1, 0.2], "one number of seconds per worker"),
        ([-0.1], "not negative"),
        ([math.nan], "finite"),
        ([math.inf], "finite"),
    ):
        with pytest.raises(ValueError, match=error):
            core.decide(tree, [1, 2, 3, 4], 4, [state], None, before)
        with pytest.raises(ValueError, match=f"stall.*{error}"):
            core.decide(tree, [1, 2, 3, 4], 4, [state], None, None, -1, before)
        with pytest.raises(ValueError, match=error):
            core.decide_view([(-1, -1, -1)], [1], 1, [state], None, -1, before)
    with pytest.raises(TypeError, match="before must be a list"):
        core.decide(tree, [1, 2, 3, 4], 4, [state], None, 0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stall must be a list"):
        core.decide(tree, [1, 2, 3, 4], 4, [state], stall=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        core.decide_view([(-1, -1, -1)], [1], 1, [state], ["soon"])  # type: ignore[list-item]
    assert isinstance(Decider, type)


@pytest.mark.parametrize("rest", [5, 0])  # 0: a text whose tokens are not counted yet
def test_an_empty_prompt_is_a_miss_on_the_least_loaded(rest: int) -> None:
    trees = PromptTrees(page_size=PAGE)
    ws = [Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")]
    ws[0].in_flight = 2  # running, none waiting: the load breaks the tie
    d = PromptTree(trees, Thresholds(), CostModel()).select(
        RouteRequest((), "", None, rest_tokens=rest), ws
    )
    assert (d.worker, d.reason, d.predicted_cached) == (ws[1], "cache_miss", 0)


def test_new_prefixes_spread_over_idle_workers_by_the_work_they_drew() -> None:
    """Prompts held nowhere, at an idle moment, spread over the workers by the work each drew
    lately: not all to the one whose speed fit says it is a little faster (its cache would
    churn while the others' age). A worker four times slower starts them later by more than
    its share of the work makes up, and gets none."""

    def new_prefixes(token_x: list[float], count: int) -> list[str]:
        clock = Clock()
        ws = [Worker(f"http://127.0.0.1:{i}") for i in range(len(token_x))]
        for w, x in zip(ws, token_x, strict=True):
            w.speed.token_x = x
        policy = PromptTree(PromptTrees(page_size=PAGE, clock=clock), Thresholds(), CostModel())
        policy.heat = Heat(PAGE, clock=clock)
        chosen = []
        for i in range(count):
            request = RouteRequest(array("I", [1000 + i] * 64), "", None)
            chosen.append(policy.select(request, ws).worker.url[-1])
            clock.now += 1.0
        return chosen

    assert sorted(new_prefixes([0.95, 1.0, 1.0, 1.0], 8)) == list("00112233")
    assert "3" not in new_prefixes([1.0, 1.0, 1.0, 4.0], 6)


def test_a_new_prefix_waits_on_a_fast_worker_rather_than_start_on_a_much_slower_one() -> None:
    """Two workers at full speed with a request queued each, two 4x slower and idle: a new
    prefix goes to a fast one (it starts later but finishes about as soon, and the requests
    that reuse it later are served there at full speed)."""
    clock = Clock()
    ws = [Worker(f"http://127.0.0.1:{i}") for i in range(4)]
    for w, x in zip(ws, (1.0, 1.0, 4.0, 4.0), strict=True):
        w.speed.token_x = x
    for w in ws[:2]:
        w.in_flight = w.unstarted = 1
        w.in_flight_tokens = 1024
    policy = PromptTree(PromptTrees(page_size=PAGE, clock=clock), Thresholds(), CostModel())
    policy.heat = Heat(PAGE, clock=clock)
    d = policy.select(RouteRequest(array("I", [7] * 1024), "", None), ws)
    assert (d.worker, d.reason) == (ws[0], "cache_miss")


def test_tokens_in_any_sequence_or_iterable_decide_alike() -> None:
    """An array('I') is read in place; a list, a tuple or an iterator is converted first:
    the same prompt decides the same, and counts once for the heat."""
    trees = PromptTrees(page_size=PAGE)
    tokens = list(range(40))
    trees.record(WorkerType.COLOCATED, "http://127.0.0.1:2", tokens[:32])
    states = [WorkerState("http://127.0.0.1:1"), WorkerState("http://127.0.0.1:2")]
    tree = trees.trees[WorkerType.COLOCATED]
    heat = Heat(PAGE, clock=Clock())
    core = CostModel().decider("prompt_tree", PAGE, heat=heat)
    forms = (array("I", tokens), tokens, tuple(tokens))
    choices = [core.decide(tree, form, len(tokens), states) for form in forms]
    # (an iterator too: the binding reads any iterable, though the stubs promise sequences)
    choices.append(core.decide(tree, iter(tokens), len(tokens), states))  # type: ignore[arg-type]
    assert all(c[:3] == (1, "cache_hit", 32) for c in choices), choices
    assert heat.bump(tokens, 32) == pytest.approx(4.0)  # each form counted the same prefix
