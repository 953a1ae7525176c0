"""Prefix heat: how many recent requests reused a prefix, and what it changes in a move."""

from __future__ import annotations

from array import array

import pytest

from mempool._radix import Heat
from router.policies import CostModel, PromptTree, RouteRequest, Thresholds
from router.trees import PromptTrees
from router.workers import Worker, WorkerType


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heat_counts_earlier_requests_and_decays() -> None:
    clock = Clock()
    heat = Heat(page_size=4, half_life_s=10.0, clock=clock)
    tokens = list(range(40))
    assert heat.bump(tokens, 3) == 0.0  # under a page: no prefix
    assert heat.bump(tokens, 16) == 0.0  # the first request
    assert heat.bump(array("I", tokens), 16) == pytest.approx(1.0)  # same key either type
    assert heat.bump(tokens, 20) == 0.0  # a longer prefix is another prefix
    clock.now = 10.0  # one half-life later
    assert heat.bump(tokens, 16) == pytest.approx(1.0)  # 2 requests, halved


def test_a_hot_prefix_leaves_a_busy_holder_where_a_cold_one_stays() -> None:
    """A conversation's own history (reused by nobody else) stays on its holder behind a
    queue; a prompt many requests share spreads as soon as its holder queues."""
    trees = PromptTrees(page_size=16)
    tokens = list(range(3000))
    ws = [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    trees.record(WorkerType.COLOCATED, ws[0].url, tokens[:2992])
    ws[0].in_flight_tokens = 10_000  # 0.4 s of queued prefill on the holder
    ws[1].reported_waiting = 2  # the other one has a little queue of its own
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())

    def choose() -> Worker:
        return policy.select(RouteRequest(tokens, "", None), ws).worker

    assert choose() is ws[0]  # cold: the copy would cost 3 x 0.12 s on ws[1]
    for _ in range(8):  # the same prefix, again and again: hot
        choose()
    assert choose() is ws[1]


def test_a_hot_prefix_does_not_move_into_a_full_cache() -> None:
    """The heat pays for the part of a copy the other worker has free KV for; past that the
    copy evicts other prefixes, as hot as those its eviction order keeps, and costs in full
    (the 10-prefix sweep cell: pulls into full caches took the hit ratio from 0.92 down to
    0.77-0.87)."""
    trees = PromptTrees(page_size=16)
    tokens = list(range(3000))
    ws = [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    trees.record(WorkerType.COLOCATED, ws[0].url, tokens[:2992])
    ws[0].in_flight_tokens = 10_000
    ws[1].reported_waiting = 2
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())

    def choose() -> Worker:
        return policy.select(RouteRequest(tokens, "", None), ws).worker

    for _ in range(8):
        choose()
    ws[1].free_tokens = 0  # its KV events say its cache is full
    assert choose() is ws[0]
    ws[1].free_tokens = 500  # a sixth of the copy fits: the rest evicts, at full cost
    assert choose() is ws[0]
    ws[1].free_tokens = 3000  # the copy fits
    assert choose() is ws[1]
    ws[1].free_tokens = -1  # not known (no KV events): as before
    assert choose() is ws[1]


def test_a_cold_prefix_leaves_a_busy_holder_for_an_idle_worker_with_room_for_it() -> None:
    """A copy into an idle worker's free KV evicts nothing and holds up no one: it costs its
    own TTFT only (the tenants preset: charged, an empty worker lacking the public prefix
    every prompt starts with got none of 240 requests)."""
    trees = PromptTrees(page_size=16)
    tokens = list(range(3000))
    ws = [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    trees.record(WorkerType.COLOCATED, ws[0].url, tokens[:2992])
    ws[0].in_flight_tokens = 5_000  # 0.2 s of queued prefill on the holder
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())
    clock = Clock()
    policy.heat = Heat(page_size=16, half_life_s=0.001, clock=clock)  # each asking stays cold

    def choose() -> Worker:
        clock.now += 1.0
        return policy.select(RouteRequest(tokens, "", None), ws).worker

    ws[1].free_tokens = 3000  # idle, and the copy fits: 0.12 s against 0.2 s
    assert choose() is ws[1]
    ws[1].free_tokens = 500  # most of the copy evicts other cache: 0.12 s, paid once more
    assert choose() is ws[0]
    ws[1].free_tokens = -1  # not known (no KV events): paid once more
    assert choose() is ws[0]
    ws[1].free_tokens, ws[1].reported_waiting = 3000, 1  # it would hold up one waiting there
    assert choose() is ws[0]
    ws[1].reported_waiting, ws[1].in_flight = 0, 1  # not idle: what runs there grows into that KV
    assert choose() is ws[0]


def test_share_is_a_prefix_part_of_all_recent_requests() -> None:
    clock = Clock()
    heat = Heat(page_size=4, half_life_s=10.0, clock=clock)
    a, b = list(range(16)), list(range(100, 116))
    assert heat.bump(a, 16) == 0.0 and heat.share(0.0) == 0.0  # nothing before it
    heat.bump(b, 16)
    heat.bump(a, 0)  # a request that matched nothing still counts among all of them
    assert heat.bump(a, 16) == pytest.approx(1.0)
    assert heat.share(1.0) == pytest.approx(1 / 3)  # a was 1 of the 3 requests before


def test_a_hot_prefix_with_copies_enough_for_its_share_stays_on_its_holder() -> None:
    """Among many hot prefixes, one with its fair share of workers already stays behind a
    queue its only-prefix twin would leave: another copy would only evict other prefixes
    (caches full of hot prefixes, the 10-prefix sweep cell)."""
    trees = PromptTrees(page_size=16)
    ws = [Worker(f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    prompts = [list(range(k * 10_000, k * 10_000 + 3000)) for k in range(4)]
    for k, tokens in enumerate(prompts):
        trees.record(WorkerType.COLOCATED, ws[k % 2].url, tokens[:2992])
    policy = PromptTree(trees, Thresholds(balance_abs=1000), CostModel())
    for _ in range(8):  # four prefixes, equally hot: each is a quarter of the traffic
        for tokens in prompts:
            policy.select(RouteRequest(tokens, "", None), ws)
    ws[0].in_flight_tokens = 10_000  # 0.4 s of queued prefill on the holder of 0 and 2
    ws[1].reported_waiting = 2
    assert policy.select(RouteRequest(prompts[0], "", None), ws).worker is ws[0]
