"""The page radix tree against a brute-force model: match, insert, delete, evict, locks."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mempool.errors import BlockInUse, InvalidRequest
from mempool.radix import RadixTree

PAGE = 2


class FakeClock:
    """Deterministic time so LRU order and TTL expiry are testable."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


PagePath = tuple[tuple[int, ...], ...]  # the pages from the root down


def pages(tokens: list[int]) -> list[tuple[int, ...]]:
    full = len(tokens) // PAGE * PAGE
    return [tuple(tokens[i : i + PAGE]) for i in range(0, full, PAGE)]


class Model:
    """Cached page sequences as a prefix-closed dict: page path -> address."""

    def __init__(self) -> None:
        self.entries: dict[PagePath, int] = {}

    def match(self, tokens: list[int]) -> list[int]:
        out: list[int] = []
        path: PagePath = ()
        for page in pages(tokens):
            path = (*path, page)
            if path not in self.entries:
                break
            out.append(self.entries[path])
        return out

    def insert(self, tokens: list[int], addrs: list[int]) -> tuple[int, list[int]]:
        existing, dups = 0, []
        path: PagePath = ()
        for page, addr in zip(pages(tokens), addrs, strict=True):
            path = (*path, page)
            if path in self.entries:
                existing += 1
                if self.entries[path] != addr:
                    dups.append(addr)
            else:
                self.entries[path] = addr
        return existing, dups

    def extensions(self, path: PagePath) -> list[PagePath]:
        return [p for p in self.entries if len(p) == len(path) + 1 and p[: len(path)] == path]

    def delete(self, tokens: list[int]) -> set[int]:
        path: PagePath = ()
        for page in pages(tokens):
            if (*path, page) not in self.entries:
                break
            path = (*path, page)
        if not path or self.extensions(path):
            return set()
        removed = set()
        while path:
            removed.add(self.entries.pop(path))
            path = path[:-1]
            if self.extensions(path):  # the parent has another continuation: it stays
                break
        return removed


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class TreeMachine(RuleBasedStateMachine):
    """Random insert/match/delete/evict/lock sequences; the tree must agree with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(page_size=PAGE, slots_per_page=1, clock=FakeClock())
        self.model = Model()
        self.next_addr = 1
        self.locks: list = []
        self.history: list[list[int]] = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """Like real traffic: an earlier prompt's prefix, often extended by a fresh tail."""
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        tokens = base[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=8))
        if not tokens:
            tokens = [0]
        self.history.append(tokens)
        return tokens

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        n = len(tokens) // PAGE
        # Engines reuse a matched prefix's blocks; a request computed in parallel brings its own.
        cached = self.model.match(tokens) if data.draw(st.booleans()) else []
        addrs = cached + list(range(self.next_addr, self.next_addr + n - len(cached)))
        self.next_addr += n
        if n == 0:
            with pytest.raises(ValueError):
                self.tree.insert(tokens, addrs + [1])
            return
        expected_existing, expected_dups = self.model.insert(tokens, addrs)
        result = self.tree.insert(tokens, addrs)
        assert result.existing_tokens == expected_existing * PAGE
        assert result.duplicates == expected_dups

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        found = self.tree.match(tokens)
        expected = self.model.match(tokens)
        assert found.value.tolist() == expected
        assert found.num_tokens == len(expected) * PAGE

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        locked_before = self.tree.protected_pages
        try:
            removed = self.tree.delete(tokens)
        except BlockInUse:
            assert locked_before > 0
            return
        assert set(removed.tolist()) == self.model.delete(tokens)

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        found = self.tree.match(tokens, split=True)  # a lock needs the node to end at the match
        if found.num_tokens:
            self.tree.lock(found.node)
            self.locks.append((found.node, tokens[: found.num_tokens]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        locked = {tuple(pages(tokens)[:i]) for _, tokens in self.locks for i in range(1, 99)}
        count, removed = self.tree.evict(n)
        assert count == len(removed)
        for addr in removed.tolist():
            path = next(p for p, a in self.model.entries.items() if a == addr)
            assert path not in locked, "evicted a locked page"
            del self.model.entries[path]
        if count < n:  # could not evict more: everything left is locked or an ancestor of it
            assert self.tree.evictable_pages == 0 or all(
                node.children or node.lock_ref for node in self.tree.nodes()
            )

    @invariant()
    def agrees(self) -> None:
        assert self.tree.num_pages == len(self.model.entries)
        for tokens, vals in self.tree.sequences():
            assert self.model.match(list(tokens)) == vals
        assert self.tree.evictable_pages >= 0 and self.tree.protected_pages >= 0


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(tokens_st, min_size=1, max_size=20), tokens_st)
@settings(max_examples=200, deadline=None)
def test_match_is_longest_cached_prefix(prompts: list[list[int]], query: list[int]) -> None:
    tree = RadixTree(page_size=PAGE, slots_per_page=0)
    for p in prompts:
        if len(p) >= PAGE:
            tree.insert(p)
    best = 0
    for p in prompts:
        common = 0
        for a, b in zip(p, query, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, common // PAGE * PAGE)
    assert tree.match(query).num_tokens == best


def test_partial_page_never_matches() -> None:
    tree = RadixTree(page_size=4, slots_per_page=1)
    tree.insert([1, 2, 3, 4, 5, 6, 7], [10])
    assert tree.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 4
    assert tree.match([1, 2, 3]).num_tokens == 0


def test_divergence_splits_node_and_keeps_values() -> None:
    tree = RadixTree(page_size=2, slots_per_page=2)
    tree.insert([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    tree.insert([1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 7, 8])
    assert tree.match([1, 2, 3, 4, 9, 9]).value.tolist() == [1, 2, 3, 4, 7, 8]
    assert tree.match([1, 2, 3, 4, 5, 6]).value.tolist() == [1, 2, 3, 4, 5, 6]
    assert len(tree.root.children) == 1
    (upper,) = tree.root.children.values()
    assert len(upper.children) == 2 and len(upper.key) == 4 * 4


def test_eviction_is_lru_and_spares_locked() -> None:
    clock = FakeClock()
    tree = RadixTree(page_size=1, slots_per_page=1, clock=clock)
    tree.insert([1, 2], [1, 2])
    tree.insert([3, 4], [3, 4])
    tree.insert([5, 6], [5, 6])
    tree.match([1, 2])  # now [3, 4] is the least recently used
    held = tree.match([5, 6], split=True)
    tree.lock(held.node)
    count, removed = tree.evict(2)
    assert count == 2 and removed.tolist() == [3, 4]
    count, removed = tree.evict(10)
    assert removed.tolist() == [1, 2]
    assert tree.num_pages == 2 and tree.protected_pages == 2
    tree.unlock(held.node)
    assert tree.evict(10)[1].tolist() == [5, 6]


def test_delete_keeps_shared_prefix_and_refuses_locked() -> None:
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([1, 2, 3], [1, 2, 3])
    tree.insert([1, 2, 9], [1, 2, 9])
    assert tree.delete([1, 2, 3]).tolist() == [3]
    assert tree.match([1, 2, 9]).num_tokens == 3
    held = tree.match([1, 2, 9], split=True)
    tree.lock(held.node)
    with pytest.raises(BlockInUse):
        tree.delete([1, 2, 9])
    assert tree.num_pages == 3
    tree.unlock(held.node)
    assert sorted(tree.delete([1, 2, 9]).tolist()) == [1, 2, 9]
    assert tree.num_pages == 0


def test_unlock_without_lock_raises_and_changes_nothing() -> None:
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([1, 2], [1, 2])
    node = tree.match([1, 2]).node
    with pytest.raises(InvalidRequest, match="not locked"):
        tree.unlock(node)
    assert tree.evictable_pages == 2


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([], ValueError),
        ("abc", TypeError),
        ([1.5, 2.0], TypeError),
        ([None], TypeError),
        ([-1, 2], ValueError),
        ([2**32, 1], ValueError),
        (b"\x00\x01", TypeError),
    ],
)
def test_bad_tokens_raise_clear_errors(tokens: object, error: type) -> None:
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([7, 8], [1, 2])
    with pytest.raises(error, match="token"):
        tree.match(tokens)  # type: ignore[arg-type]
    with pytest.raises(error, match="token"):
        tree.insert(tokens, [1])  # type: ignore[arg-type]
    assert tree.num_pages == 2


def test_wrong_value_length_rejected_without_change() -> None:
    tree = RadixTree(page_size=2, slots_per_page=2)
    with pytest.raises(ValueError, match="expected 4 addresses for 2 whole pages"):
        tree.insert([1, 2, 3, 4], [1, 2, 3])
    with pytest.raises(ValueError, match="needs one address"):
        tree.insert([1, 2, 3, 4])
    with pytest.raises(TypeError, match="64-bit"):
        tree.insert([1, 2], [1, -5])
    assert tree.num_pages == 0


def test_array_tokens_accepted() -> None:
    tree = RadixTree(page_size=2, slots_per_page=1)
    tree.insert(array("I", [1, 2, 3, 4]), [5, 6])
    assert tree.match([1, 2, 3, 4]).value.tolist() == [5, 6]


# ---------------------------------------------------------------- global prompt tree use


def test_holders_report_per_instance_prefix() -> None:
    tree = RadixTree(page_size=2, slots_per_page=0)
    tree.insert([1, 2, 3, 4, 5, 6], holder="a")
    tree.insert([1, 2, 3, 4], holder="b")
    tree.insert([1, 2, 9, 9], holder="c")
    found = tree.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert found.num_tokens == 6
    assert found.holder_tokens == {"a": 6, "b": 4, "c": 2}


def test_holder_ttl_expiry_prunes() -> None:
    clock = FakeClock()
    tree = RadixTree(page_size=1, slots_per_page=0, clock=clock)
    tree.insert([1, 2, 3], holder="old")  # t=1
    tree.insert([1, 2], holder="new")  # t=2
    assert tree.match([1, 2, 3], ttl=0.5).holder_tokens == {}
    pruned = tree.expire(older_than=1.5)
    assert pruned == 1  # page 3 was held by "old" alone
    assert tree.match([1, 2, 3]).holder_tokens == {"new": 2}


def test_remove_holder_after_feedback_and_death() -> None:
    tree = RadixTree(page_size=1, slots_per_page=0)
    tree.insert([1, 2, 3, 4], holder="a")
    tree.insert([1, 2, 3, 4, 5], holder="b")
    tree.insert([1, 2, 3, 7], holder="a")
    # "a" reported only 2 cached tokens for [1, 2, 3, 4]: it lacks page 3 and all below.
    tree.remove_holder("a", [1, 2, 3, 4], keep_tokens=2)
    assert tree.match([1, 2, 3, 4, 5]).holder_tokens == {"a": 2, "b": 5}
    assert tree.match([1, 2, 3, 7]).num_tokens == 3  # "b" keeps page 3; page 7 is gone
    assert tree.match([1, 2, 3, 7]).holder_tokens == {"a": 2, "b": 3}
    tree.remove_holder("b")
    assert tree.match([1, 2, 3, 4, 5]).holder_tokens == {"a": 2}
    assert tree.num_pages == 2


def test_match_without_split_leaves_the_tree_alone() -> None:
    """Partial hits must not fragment the tree: a router matches every request."""
    tree = RadixTree(page_size=2, slots_per_page=1)
    tree.insert(list(range(16)), list(range(8)))
    for cut in range(2, 16, 2):
        found = tree.match(list(range(cut)) + [99, 99])
        assert found.value.tolist() == list(range(cut // 2))
        assert found.node == tree.root  # the only node is covered in part (handles compare equal)
    assert len(list(tree.nodes())) == 1
    exact = tree.match(list(range(6)), split=True)
    assert len(list(tree.nodes())) == 2 and len(exact.node.key) == 6 * 4


def test_holders_of_a_partly_covered_node_count_only_the_covered_pages() -> None:
    tree = RadixTree(page_size=2, slots_per_page=0)
    tree.insert([1, 2, 3, 4, 5, 6], holder="a")
    assert tree.match([1, 2, 3, 4, 9, 9]).holder_tokens == {"a": 4}
