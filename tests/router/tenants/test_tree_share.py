"""A tenant's share of the prompt trees (router.tenants.tree_share): over its share a tenant
loses its own oldest paths, never another's, and plain requests are not counted."""

from __future__ import annotations

import random

from router.tenants.tree_share import TreeShares
from router.trees import PromptTrees
from router.workers import WorkerType

PAGE = 4
C = WorkerType.COLOCATED
URL = "http://w0"


def path(seed: int, pages: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1 << 30) for _ in range(pages * PAGE)]


def trees(limits: dict[str, int], max_pages: int = 1 << 20) -> PromptTrees:
    t = PromptTrees(page_size=PAGE, max_pages=max_pages)
    t.shares = TreeShares(PAGE, lambda tenant: limits.get(tenant, 0))
    return t


def held(t: PromptTrees, tokens: list[int]) -> int:
    return t.match(C, tokens).held.get(URL, 0)


def test_a_flooding_tenant_loses_its_own_paths_never_anothers() -> None:
    t = trees({"a": 30, "b": 12})
    mine = [path(i) for i in range(4)]
    for p in mine:
        t.record(C, URL, p, tenant="a")
    for i in range(100, 200):  # a fresh namespace each time: 3 new pages
        t.record(C, URL, path(i), tenant="b")
    assert all(held(t, p) == len(p) for p in mine)  # A's paths all stay
    assert t.shares is not None and t.shares.pages(C, "b") <= 12
    assert t.size(C) == 4 * 3 + 12
    assert held(t, path(199)) == 3 * PAGE and held(t, path(100)) == 0  # B keeps its newest
    assert t.shares.deleted_pages == (100 - 4) * 3


def test_without_a_share_the_size_bound_evicts_everyones_paths() -> None:
    """The attack the share bounds: the trees' LRU bound alone takes A's paths."""
    t = trees({}, max_pages=40)
    mine = [path(i) for i in range(4)]
    for p in mine:
        t.record(C, URL, p, tenant="a")
    for i in range(100, 200):
        t.record(C, URL, path(i), tenant="b")
    assert all(held(t, p) == 0 for p in mine)


def test_a_conversation_extending_its_paths_is_counted_once() -> None:
    """Turns that extend the last one add only their new pages; deleting an old turn that a
    later one extends frees nothing, and its pages go with the path that extends it."""
    t = trees({"a": 16})
    assert t.shares is not None
    talk = path(1, pages=2)
    for turn in range(6):  # 2, 4, 6, ... pages: over 16 the oldest turns come up
        t.record(C, URL, talk, tenant="a")
        talk = talk + path(50 + turn, pages=2)
    assert t.shares.pages(C, "a") == t.size(C) == 12  # one path, counted as the tree holds
    t.record(C, URL, path(99, pages=8), tenant="a")  # 8 more: the conversation goes
    assert t.size(C) == t.shares.pages(C, "a") == 8
    t.record(C, URL, path(98, pages=2), tenant="plain")  # no share: not counted
    t.record(C, URL, path(97, pages=2))
    assert t.shares.pages(C, "plain") == 0 and t.size(C) == 12


def test_a_path_already_gone_is_not_counted_again() -> None:
    t = trees({"a": 6})
    assert t.shares is not None
    t.record(C, URL, path(1), tenant="a")
    t.forget(URL)  # its pages leave the tree with their last holder
    t.record(C, URL, path(2), tenant="a")
    t.record(C, URL, path(3), tenant="a")  # over: the first path goes, uncounted
    assert t.shares.pages(C, "a") == 6 == t.size(C)
    assert held(t, path(2)) == held(t, path(3)) == 3 * PAGE
    t.clear()
    assert t.shares.pages(C, "a") == 0
