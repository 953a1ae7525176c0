"""The incremental radix tree against the old whole-tree algorithms, operation by operation.

Random insert/match/lock/unlock/evict/expire/remove_holder/delete/reset sequences run on
the native `RadixTree` and on `WholeTreeRadix` (the whole-tree code, kept in the tests);
every result (evicted values in order, pages pruned, matches, holders) and the whole state
after every step must be identical. The clock advances on every call, so no two evictable
leaves share a last_access and the LRU order is fully determined. White-box checks then hold the
incremental structures to what they summarise, and assert that eviction, expiry and
forgetting a holder never walk the whole tree.
"""

from __future__ import annotations

from collections.abc import Hashable
from itertools import islice
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mempool.errors import BlockInUse
from mempool.radix import RadixTree, TreeNode
from tests.mempool.radix_model import TreeNode as ModelNode
from tests.mempool.whole_tree_radix import WholeTreeRadix

PAGE = 2
HOLDERS = ("a", "b", "c")


class Ticker:
    """A clock that moves on by one on every reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def path_of(tree: RadixTree | WholeTreeRadix, node: TreeNode | ModelNode) -> tuple[bytes, ...]:
    """A node's identity across the two trees: the keys from the root down to it."""
    keys = []
    while node != tree.root and node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(reversed(keys))


def state(tree: RadixTree | WholeTreeRadix) -> list[tuple[Any, ...]]:
    """Everything observable about every node, parents first."""
    return [
        (
            path_of(tree, n),
            None if n.value is None else n.value.tolist(),
            n.last_access,
            n.lock_ref,
            None if n.holders is None else sorted(n.holders.items()),
        )
        for n in tree.nodes()
    ]


class NoWholeTreeWalk:
    """Fails if the tree walked all its nodes (the native tree counts its whole-tree walks)."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.before = 0

    def __enter__(self) -> None:
        self.before = self.tree._full_walks

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert self.tree._full_walks == self.before, "walked the whole tree"


class Differential(RuleBasedStateMachine):
    """One operation on both trees per rule; results and states must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(page_size=PAGE, slots_per_page=1, clock=Ticker())
        self.ref = WholeTreeRadix(page_size=PAGE, slots_per_page=1, clock=Ticker())
        self.next_addr = 1
        self.locks: list[tuple[TreeNode, ModelNode]] = []
        self.history: list[list[int]] = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """An earlier prompt's prefix, often extended by a fresh tail (as traffic does)."""
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        tokens = base[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=8))
        tokens = tokens if len(tokens) >= PAGE else [0, 0]
        self.history.append(tokens)
        return tokens

    @rule(data=st.data(), holder=st.sampled_from((None, *HOLDERS)))
    def insert(self, data: st.DataObject, holder: Hashable | None) -> None:
        tokens = self.draw_tokens(data)
        n = len(tokens) // PAGE
        addrs = list(range(self.next_addr, self.next_addr + n))
        self.next_addr += n
        got = self.tree.insert(tokens, addrs, holder=holder)
        want = self.ref.insert(tokens, addrs, holder=holder)
        assert (got.existing_tokens, got.new_tokens, got.duplicates) == (
            want.existing_tokens,
            want.new_tokens,
            want.duplicates,
        )
        assert path_of(self.tree, got.node) == path_of(self.ref, want.node)

    @rule(
        data=st.data(),
        ttl=st.sampled_from((None, 0.5, 3.0, 12.0)),
        split=st.booleans(),
        lock=st.booleans(),
    )
    def match(self, data: st.DataObject, ttl: float | None, split: bool, lock: bool) -> None:
        tokens = self.draw_tokens(data)
        got = self.tree.match(tokens, ttl=ttl, split=split or lock)
        want = self.ref.match(tokens, ttl=ttl, split=split or lock)
        assert got.num_tokens == want.num_tokens
        assert got.value.tolist() == want.value.tolist()
        assert got.holder_tokens == want.holder_tokens
        assert path_of(self.tree, got.node) == path_of(self.ref, want.node)
        if lock and got.num_tokens:
            self.tree.lock(got.node)
            self.ref.lock(want.node)
            self.locks.append((got.node, want.node))

    @rule(data=st.data(), ttl=st.sampled_from((None, 0.5, 3.0, 12.0)))
    def holders(self, data: st.DataObject, ttl: float | None) -> None:
        """The router's one-walk lookup: a match's holders, in the same order, with the
        same nodes marked used."""
        tokens = self.draw_tokens(data)
        got = self.tree.holders(tokens, ttl=ttl)
        want = self.ref.match(tokens, ttl=ttl).holder_tokens
        assert list(got.items()) == list(want.items())

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        mine, theirs = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(mine)
        self.ref.unlock(theirs)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        with NoWholeTreeWalk(self.tree):
            count, removed = self.tree.evict(n)
        want_count, want_removed = self.ref.evict(n)
        assert (count, removed.tolist()) == (want_count, want_removed.tolist())

    @rule(back=st.integers(0, 12))
    def expire(self, back: int) -> None:
        older_than = self.tree.clock() - back
        self.ref.clock()  # both clocks stay in step
        with NoWholeTreeWalk(self.tree):
            pruned = self.tree.expire(older_than)
        assert pruned == self.ref.expire(older_than)

    @rule(holder=st.sampled_from(HOLDERS))
    def forget_holder(self, holder: str) -> None:
        with NoWholeTreeWalk(self.tree):
            pruned = self.tree.remove_holder(holder)
        assert pruned == self.ref.remove_holder(holder)

    @rule(data=st.data(), holder=st.sampled_from(HOLDERS), keep=st.integers(0, 10))
    def drop_holder_on_path(self, data: st.DataObject, holder: str, keep: int) -> None:
        tokens = self.draw_tokens(data)
        pruned = self.tree.remove_holder(holder, tokens, keep_tokens=keep)
        assert pruned == self.ref.remove_holder(holder, tokens, keep_tokens=keep)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        try:
            removed = self.tree.delete(tokens).tolist()
        except BlockInUse:
            with pytest.raises(BlockInUse):
                self.ref.delete(tokens)
            return
        assert removed == self.ref.delete(tokens).tolist()

    @rule(take=st.integers(0, 30))
    def lru_order(self, take: int) -> None:
        got = [path_of(self.tree, n) for n in islice(self.tree.lru_unlocked(), take)]
        want = [path_of(self.ref, n) for n in islice(self.ref.lru_unlocked(), take)]
        assert got == want

    @precondition(lambda self: self.next_addr % 7 == 0)  # now and then
    @rule()
    def reset(self) -> None:
        assert self.tree.reset().tolist() == self.ref.reset().tolist()

    @invariant()
    def same_state(self) -> None:
        assert state(self.tree) == state(self.ref)
        assert self.tree.pretty() == self.ref.pretty()
        assert (self.tree.evictable_pages, self.tree.protected_pages) == (
            self.ref.evictable_pages,
            self.ref.protected_pages,
        )

    @invariant()
    def structures_summarise_the_tree(self) -> None:
        check_structures(self.tree)


def check_structures(tree: RadixTree) -> None:
    """The incremental structures hold exactly what a scan of the tree would find: the native
    tree checks itself (queued leaves are the tier leaves, each with a heap entry no later than
    its last use; every holder pair counted, indexed by holder, with an expiry entry no later
    than its confirmation; no empty holder sets; page counts) and raises AssertionError."""
    tree._check()


TestDifferential = Differential.TestCase
TestDifferential.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)


def test_stale_entries_are_compacted() -> None:
    """Matching the same leaves again and again must not grow the heaps without bound."""
    tree = RadixTree(page_size=1, slots_per_page=0, clock=Ticker())
    for i in range(10):
        tree.insert([i, i + 1], holder="a")
    for _ in range(2000):
        for i in range(10):
            tree.match([i, i + 1])
            tree.insert([i, i + 1], holder="a")
    assert tree._heap_size() <= 2 * 10 + 64 + 1
    assert tree._expiry_size <= 2 * 10 + 64 + 1
    assert tree.evict(1)[0] == 2 and tree.num_pages == 18
    check_structures(tree)


def test_eviction_cost_follows_what_it_removes() -> None:
    """Evicting from a large tree pops a handful of heap entries, not one per leaf."""
    tree = RadixTree(page_size=1, slots_per_page=1, clock=Ticker())
    for i in range(5000):  # one shared first page, then two pages of its own per prompt
        tree.insert([1000, i, 7], [3 * i, 3 * i + 1, 3 * i + 2])
    heap_before = tree._heap_size()
    with NoWholeTreeWalk(tree):
        count, removed = tree.evict(3)
    assert count == 4 and removed.tolist() == [1, 2, 4, 5]  # the two oldest prompts' own
    assert heap_before - tree._heap_size() <= 2 + 64  # popped: the two, plus stale ones
    with NoWholeTreeWalk(tree):
        assert tree.remove_holder("nobody") == 0
        assert tree.expire(10**9) == 0
