"""Prompt trees and policies in-process: the rules, without HTTP."""

from __future__ import annotations

import pytest

from router.policies import (
    CacheAware,
    Cost,
    CostModel,
    PromptTree,
    RouteRequest,
    Session,
    Thresholds,
    make_policy,
    policy_name,
)
from router.trees import PromptTrees
from router.workers import (
    Agent,
    BreakerConfig,
    BreakerState,
    Worker,
    WorkerRegistry,
    WorkerType,
    normalize_url,
)
from shared.namespaces import CacheNamespace

C = WorkerType.COLOCATED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def test_trees_match_per_worker_and_expire() -> None:
    clock = Clock()
    trees = PromptTrees(page_size=4, ttl_s=10, clock=clock)
    trees.record(C, "a", list(range(12)))
    clock.now += 8
    trees.record(C, "b", list(range(8)))
    assert trees.match(C, list(range(20))).held == {"a": 12, "b": 8}
    clock.now += 5  # "a" is 13 s old: past the TTL, "b" is 5 s old
    assert trees.match(C, list(range(20))).held == {"b": 8}
    assert trees.expire() == 1  # a's third page was a's alone
    assert trees.match(C, list(range(20))).held == {"b": 8}


def test_trees_forget_a_dead_worker_and_correct_on_feedback() -> None:
    trees = PromptTrees(page_size=4)
    trees.record(C, "a", list(range(16)))
    trees.record(C, "b", list(range(16)))
    trees.feedback(C, "a", list(range(16)), predicted=12, reported=4)
    assert trees.match(C, list(range(16))).held == {"a": 4, "b": 16}
    assert trees.stats.corrections == 1
    trees.forget("b")
    assert trees.match(C, list(range(16))).held == {"a": 4}


def test_trees_size_bound_evicts_lru() -> None:
    trees = PromptTrees(page_size=1, max_pages=10)
    for start in range(0, 100, 5):
        trees.record(C, "a", list(range(start, start + 5)))
    assert trees.size(C) <= 10
    assert trees.match(C, [95, 96]).held == {"a": 2}  # the newest survives


def test_prompt_tree_prefers_the_holder_and_names_longer_holders() -> None:
    trees = PromptTrees(page_size=4)
    ws = workers(3)
    tokens = list(range(40))
    trees.record(C, ws[1].url, tokens[:32])
    trees.record(C, ws[2].url, tokens[:16])
    policy = PromptTree(trees, Thresholds(), CostModel())
    d = policy.select(RouteRequest(tokens, "", None), ws)
    assert d.worker is ws[1] and d.predicted_cached == 32 and d.holders == []
    assert d.reason == "cache_hit"
    ws[1].in_flight = 200  # far beyond the others: the guard moves the request
    d = policy.select(RouteRequest(tokens, "", None), ws)
    assert d.worker is not ws[1] and d.reason == "overload"
    assert d.holders == []  # these workers cannot pull: nobody is named
    for i, w in enumerate(ws):
        w.agent = Agent(i + 1, "127.0.0.1", 7000 + i)
    d = policy.select(RouteRequest(tokens, "", None), ws)
    assert d.worker is not ws[1] and d.reason == "overload_pull"
    assert d.holders[0] == (ws[1], 32) and d.pull_from is ws[1]  # the holder, to pull from


def test_a_salted_request_is_priced_a_pull_behind_a_public_prefix_only() -> None:
    """Behind a public prefix, a move off a busy holder is priced as a pull of the tenant's
    whole prefix (the worker pulls it by its key); salted from the first token, as a
    recompute, with no holder named (router.policies.pull_limit says why). Another tenant's
    identical prompt finds the public part only."""
    trees = PromptTrees(page_size=4)
    ws = workers(3)
    for i, w in enumerate(ws):
        w.agent = Agent(i + 1, "127.0.0.1", 7000 + i)
    policy = PromptTree(trees, Thresholds(), CostModel())
    tokens = list(range(400))
    decided = {}
    for shared in (None, 160, 0):
        ns = None if shared is None else CacheNamespace(cache_salt="t", shared_prefix_tokens=shared)
        request = RouteRequest(tokens, "", None, namespace=ns)
        trees.record(C, ws[1].url, request.tree_key(tokens, 4))  # as its answer records it
        ws[1].in_flight = 200  # far beyond the others: the guard moves the request
        decided[shared] = policy.select(request, ws)
        ws[1].in_flight = 0
    whole, public, private = decided[None], decided[160], decided[0]
    for d in (whole, public):
        assert d.reason == "overload_pull" and d.pull_from is ws[1]
        assert d.holders == [(ws[1], 396)] and d.work == whole.work
    assert private.reason == "overload" and private.pull_from is None and private.holders == []
    other = CacheNamespace(cache_salt="u", shared_prefix_tokens=160)
    ws[1].in_flight = 200
    d = policy.select(RouteRequest(tokens, "", None, namespace=other), ws)
    assert d.holders == [(ws[1], 160)]  # the public part, nothing of tenant t's


def test_a_shared_short_prefix_does_not_pull_all_traffic_to_its_holder() -> None:
    """A system prompt every request shares must not pile every request on one worker."""
    trees = PromptTrees(page_size=16)
    ws = workers(4)
    system = list(range(512))
    history = system + list(range(100_000, 108_000))
    trees.record(C, ws[0].url, history)
    policy = PromptTree(trees, Thresholds(), CostModel())
    ws[0].in_flight, ws[0].in_flight_tokens = 4, 2_000  # ~90 ms of work queued; others idle
    new_user = RouteRequest(system + list(range(200_000, 200_300)), "", None)
    d = policy.select(new_user, ws)
    assert d.worker is not ws[0] and d.reason == "overload"  # 512 cached tokens save ~20 ms
    turn = RouteRequest(history + list(range(300_000, 300_050)), "", None)
    d = policy.select(turn, ws)
    assert d.worker is ws[0] and d.reason == "cache_hit"  # 8.5K cached tokens save ~0.3 s


def test_leaving_a_holder_must_also_pay_for_the_recomputed_prefix() -> None:
    """A long history stays with its holder behind one queued cold prompt: moving it would
    save this turn ~50 ms but put 0.8 s of recompute in front of whoever queues there next.
    Behind three cold prompts it moves."""
    trees = PromptTrees(page_size=16)
    ws = workers(4)
    history = list(range(20_000))
    trees.record(C, ws[0].url, history)
    policy = PromptTree(trees, Thresholds(), CostModel())
    turn = RouteRequest(history + list(range(900_000, 900_120)), "", None)
    ws[0].in_flight, ws[0].in_flight_tokens = 1, 21_000  # one cold 21K prompt queued (0.84 s)
    d = policy.select(turn, ws)
    assert d.worker is ws[0] and d.reason == "cache_hit"
    ws[0].in_flight, ws[0].in_flight_tokens = 3, 63_000  # three of them (2.5 s)
    d = policy.select(turn, ws)
    assert d.worker is not ws[0] and d.reason == "overload"


def test_prompt_tree_without_any_hit_goes_to_the_least_loaded() -> None:
    trees = PromptTrees(page_size=4)
    ws = workers(3)
    ws[0].in_flight, ws[1].in_flight = 3, 1
    ws[2].in_flight = 2
    d = PromptTree(trees, Thresholds(), CostModel()).select(RouteRequest([1] * 40, "", None), ws)
    assert d.worker is ws[1] and d.reason == "cache_miss"


def test_predicted_cached_leaves_one_token_to_compute() -> None:
    trees = PromptTrees(page_size=4)
    ws = workers(1)
    trees.record(C, ws[0].url, list(range(16)))
    d = PromptTree(trees, Thresholds(), CostModel()).select(
        RouteRequest(list(range(16)), "", None), ws
    )
    assert d.predicted_cached == 12  # the engine recomputes the last prompt token


def test_cost_weighs_queue_against_reuse() -> None:
    trees = PromptTrees(page_size=4)
    ws = workers(2)
    tokens = list(range(1000))
    trees.record(C, ws[0].url, tokens[:800])
    cost = Cost(trees, Thresholds(), CostModel())
    assert cost.select(RouteRequest(tokens, "", None), ws).worker is ws[0]
    ws[0].in_flight_tokens = 100_000  # a long prefill queue outweighs 800 cached tokens
    d = cost.select(RouteRequest(tokens, "", None), ws)
    assert d.worker is ws[1] and d.holders == [] and d.reason == "cache_miss"


def test_cache_aware_follows_sglang_rules() -> None:
    ws = workers(2)
    policy = CacheAware(Thresholds(cache=0.5, balance_abs=4, balance_rel=1.5))
    first = policy.select(RouteRequest(None, "hello world, a long shared text", None), ws)
    again = policy.select(RouteRequest(None, "hello world, a long shared text!", None), ws)
    assert again.worker is first.worker and again.reason == "cache_hit"
    first.worker.in_flight = 10  # imbalance: the least-loaded wins regardless of cache
    d = policy.select(RouteRequest(None, "hello world, a long shared text?", None), ws)
    assert d.worker is not first.worker and d.reason == "balance"


def test_session_is_sticky_and_stable_when_others_leave() -> None:
    ws = workers(4)
    policy = Session()
    home = policy.select(RouteRequest(None, "", "user-7"), ws).worker
    assert all(policy.select(RouteRequest(None, "", "user-7"), ws).worker is home for _ in range(5))
    others = [w for w in ws if w is not home][:2]
    assert policy.select(RouteRequest(None, "", "user-7"), [home, *others]).worker is home


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("prompt-tree", "prompt_tree"), ("Least-Load", "least_load"), ("cost", "cost")],
)
def test_policy_names(given: str, canonical: str) -> None:
    assert policy_name(given) == canonical
    assert make_policy(given, PromptTrees(), Thresholds(), CostModel()).name == canonical


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose one of"):
        policy_name("fastest")


def test_breaker_opens_half_opens_and_closes() -> None:
    registry = WorkerRegistry(
        BreakerConfig(failure_threshold=2, success_threshold=2, timeout_s=0.0)
    )
    w = registry.add("127.0.0.1:9001")
    registry.record_failure(w)
    assert w.breaker is BreakerState.CLOSED
    registry.record_failure(w)
    assert w.breaker is BreakerState.OPEN
    assert registry.available() == [w] and w.breaker is BreakerState.HALF_OPEN  # timeout 0
    registry.record_success(w)
    registry.record_success(w)
    assert w.breaker is BreakerState.CLOSED


def test_while_requests_wait_for_a_slot_only_idle_workers_are_offered() -> None:
    registry = WorkerRegistry(BreakerConfig())
    a, b, c = (registry.add(f"127.0.0.1:900{i}") for i in range(3))
    a.state.in_flight = 2
    everyone = [a, b, c]
    assert registry.idle_first(everyone) == (everyone, False)  # nothing waits in the router
    registry.backlogged = lambda: True
    assert registry.idle_first(everyone) == ([b, c], True)
    b.state.in_flight = c.state.in_flight = 1
    assert registry.idle_first(everyone) == (everyone, False)  # none idle: the policy decides
    a.state.in_flight = b.state.in_flight = c.state.in_flight = 0
    assert registry.idle_first(everyone) == (everyone, False)  # all idle: no narrowing
    assert registry.idle_first([a]) == ([a], False)


@pytest.mark.parametrize("bad", ["", "ftp://x:1", "http://nohost", "localhost"])
def test_bad_worker_urls(bad: str) -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        normalize_url(bad)


def test_a_dropped_prefix_stays_its_workers_home_until_forgotten() -> None:
    trees = PromptTrees(page_size=4)
    trees.record(C, "a", list(range(16)))
    trees.drop(C, "a", list(range(16)), keep_tokens=4)  # evicted after its first page
    view = trees.match(C, list(range(16)))
    assert view.held == {"a": 4} and view.home == {"a": 16}
    assert view.affinity("a") == 16 and view.affinity("b") == 0
    trees.drop(C, "a", list(range(16)), keep_tokens=0)
    assert trees.match(C, list(range(16))).held == {}
    trees.forget("a")
    assert trees.match(C, list(range(16))).home == {}


def test_a_move_between_two_holders_of_the_prefix_is_a_cache_hit() -> None:
    """The least loaded holder has the longer queue of work: the other holder serves it, a
    hit (not an overload: nothing is recomputed or copied)."""
    trees = PromptTrees(page_size=4)
    ws = workers(3)
    tokens = list(range(400))
    for w in ws[:2]:
        trees.record(C, w.url, tokens[:396])
    policy = PromptTree(trees, Thresholds(), CostModel())
    ws[0].reported_pending_tokens = 50_000  # 2 s of prefill queued, no request counted
    ws[1].in_flight = 1
    d = policy.select(RouteRequest(tokens, "", None), ws)
    assert d.worker is ws[1] and d.reason == "cache_hit" and d.predicted_cached == 396


def test_a_prefix_evicted_everywhere_goes_back_where_it_lived() -> None:
    """Scattering it to whichever worker is least loaded would fill the caches with copies
    of the same prefixes; its home computes it again unless its queue costs more."""
    trees = PromptTrees(page_size=4)
    ws = workers(3)
    tokens = list(range(64))
    trees.record(C, ws[2].url, tokens[:60])
    trees.drop(C, ws[2].url, tokens[:60], keep_tokens=0)
    policy = PromptTree(trees, Thresholds(), CostModel())
    ws[2].in_flight = 1  # a little busier than the others: still its home
    decision = policy.select(RouteRequest(tokens, "", None), ws)
    assert decision.worker is ws[2] and decision.reason == "home"
    assert decision.predicted_cached == 0  # nothing is expected to be cached there
    ws[2].reported_waiting = 40  # its queue would cost more than computing elsewhere
    for t in (0.0, 1.0, 2.0, 3.0):
        ws[2].state.finish(t)
    assert policy.select(RouteRequest(tokens, "", None), ws).worker is not ws[2]


def test_leaving_a_holder_costs_more_where_requests_wait() -> None:
    """Recomputing a prefix on a worker delays each request waiting there: the busier the
    target, the longer the holder's queue must be before the prefix moves."""
    trees = PromptTrees(page_size=4)
    ws = workers(2)
    tokens = list(range(4000))
    trees.record(C, ws[0].url, tokens[:3996])
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())
    ws[0].in_flight_tokens = 5000 * 16  # 3.2 s of queued prefill on the holder
    assert policy.select(RouteRequest(tokens, "", None), ws).worker is ws[1]
    ws[1].reported_waiting = 30  # the other worker has its own queue to delay
    # a fresh policy: the first choice made the prefix warmer (Heat, tested apart)
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())
    assert policy.select(RouteRequest(tokens, "", None), ws).worker is ws[0]


def test_a_long_fresh_prompt_avoids_a_worker_where_requests_queue_for_the_next_step() -> None:
    """The engine prefills the requests waiting for its next step together: a request's
    uncached part, sent where three wait behind the one being prefilled, delays the two
    others' first tokens by all of it. So a 4K-token fresh part goes to the holder with one
    long prefill running (0.24 s of work) rather than the one with three short prompts
    waiting (12 ms); a short fresh part still goes where it starts soonest."""
    trees = PromptTrees(page_size=4)
    ws = workers(2)
    shared = list(range(400))
    for w in ws:
        trees.record(C, w.url, shared)
    ws[0].in_flight, ws[0].unstarted, ws[0].in_flight_tokens = 3, 3, 300
    ws[1].in_flight, ws[1].unstarted, ws[1].in_flight_tokens = 1, 1, 6000
    long = RouteRequest(shared + list(range(10_000, 14_000)), "", None)
    d = PromptTree(trees, Thresholds(), CostModel()).select(long, ws)
    assert d.worker is ws[1] and d.reason == "cache_hit" and d.predicted_cached == 400
    short = RouteRequest(shared + list(range(10_000, 10_040)), "", None)
    d = PromptTree(trees, Thresholds(), CostModel()).select(short, ws)
    assert d.worker is ws[0] and d.reason == "cache_hit"
