"""The native radix tree against its Python reference model, and its refusals of bad input.

A hypothesis state machine drives `mempool.radix.RadixTree` (C++) and `radix_model.RadixTree`
(the Python tree it replaced) with the same random operations, tiers included (insert into a
tier, match with ttl and split, holders, lock/unlock, evict by tier, lru_leaf, expire,
remove_holder, split, set_tier, repoint, delete, lru_unlocked, reset), compares every result
and the whole observable state after every step, and has the native tree check its own
incremental structures. Node handles kept from earlier steps must stay valid exactly while the
model's node is in the tree (or detached but still locked), and raise once it is gone.
"""

from __future__ import annotations

import gc
from array import array
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mempool.errors import BlockInUse, InvalidRequest, InvalidTokens
from mempool.radix import RadixTree, TreeNode
from tests.mempool import radix_model
from tests.mempool.radix_model import TreeNode as ModelNode
from tests.mempool.test_radix_incremental import Ticker

PAGE = 2
HOLDERS: tuple[Hashable, ...] = ("a", "b", ("a", "host"), 7)
TIERS = (0, 1, 2)


def path_of(node: TreeNode | ModelNode) -> tuple[bytes, ...]:
    """A node's identity across the two trees: the keys from the root down to it."""
    keys = []
    walk: TreeNode | ModelNode | None = node
    while walk is not None and walk.parent is not None:
        keys.append(walk.key)
        walk = walk.parent
    return tuple(reversed(keys))


def state(tree: RadixTree | radix_model.RadixTree) -> list[tuple[Any, ...]]:
    """Everything observable about every node, in the trees' walk order."""
    return [
        (
            path_of(n),
            None if n.value is None else n.value.tolist(),
            n.last_access,
            n.lock_ref,
            None if n.holders is None else list(n.holders.items()),
            n.tier,
            n.lru_stamp != 0,  # queued as a tier leaf (evictable next in its tier)
        )
        for n in tree.nodes()
    ]


class NativeAgainstModel(RuleBasedStateMachine):
    """One operation on both trees per rule; results and states must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(page_size=PAGE, slots_per_page=2, clock=Ticker())
        self.model = radix_model.RadixTree(page_size=PAGE, slots_per_page=2, clock=Ticker())
        self.next_addr = 1
        self.locks: list[tuple[TreeNode, ModelNode]] = []
        self.seen: list[tuple[TreeNode, ModelNode]] = []  # handles taken along the way
        self.history: list[list[int]] = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """An earlier prompt's prefix, often extended by a fresh tail (as traffic does)."""
        base = data.draw(st.sampled_from(self.history))
        # half the time the whole earlier prompt: a child under its leaf (a tier below it)
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        tokens = base[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=8))
        tokens = tokens if tokens else [0]
        self.history.append(tokens)
        return tokens

    def draw_node(self, data: st.DataObject) -> tuple[TreeNode, ModelNode] | None:
        mine, theirs = self.tree.nodes(), list(self.model.nodes())
        assert len(mine) == len(theirs)
        if not mine:
            return None
        # often the newest leaf (the last in the walk order is a deepest node)
        i = data.draw(st.one_of(st.just(len(mine) - 1), st.integers(0, len(mine) - 1)))
        return mine[i], theirs[i]

    def keep(self, mine: TreeNode, theirs: ModelNode) -> None:
        self.seen.append((mine, theirs))
        del self.seen[:-40]

    @rule(
        data=st.data(),
        holder=st.sampled_from((None, *HOLDERS)),
        tier=st.sampled_from(TIERS),
        cached=st.booleans(),
    )
    def insert(self, data: st.DataObject, holder: Hashable, tier: int, cached: bool) -> None:
        tokens = self.draw_tokens(data)
        n = len(tokens) // PAGE * 2
        # engines reuse a matched prefix's blocks; a request computed in parallel brings its own
        reuse = self.model.match(tokens).value.tolist() if cached else []
        if cached:
            self.tree.clock()  # the model's clock moved for that match: both stay in step
        addrs = reuse + list(range(self.next_addr, self.next_addr + n - len(reuse)))
        self.next_addr += n
        got = self.tree.insert(tokens, addrs, holder=holder, tier=tier)
        want = self.model.insert(tokens, addrs, holder=holder, tier=tier)
        assert (got.existing_tokens, got.new_tokens, got.duplicates) == (
            want.existing_tokens,
            want.new_tokens,
            want.duplicates,
        )
        assert path_of(got.node) == path_of(want.node)
        self.keep(got.node, want.node)

    @rule(
        data=st.data(),
        ttl=st.sampled_from((None, 0.5, 3.0, 12.0)),
        split=st.booleans(),
        lock=st.booleans(),
    )
    def match(self, data: st.DataObject, ttl: float | None, split: bool, lock: bool) -> None:
        tokens = self.draw_tokens(data)
        got = self.tree.match(tokens, ttl=ttl, split=split or lock)
        want = self.model.match(tokens, ttl=ttl, split=split or lock)
        assert got.num_tokens == want.num_tokens
        assert got.value.tolist() == want.value.tolist()
        assert list(got.holder_tokens.items()) == list(want.holder_tokens.items())
        assert path_of(got.node) == path_of(want.node)
        self.keep(got.node, want.node)
        if lock and got.num_tokens:
            self.tree.lock(got.node)
            self.model.lock(want.node)
            self.locks.append((got.node, want.node))

    @rule(data=st.data(), ttl=st.sampled_from((None, 0.5, 3.0)))
    def holders(self, data: st.DataObject, ttl: float | None) -> None:
        tokens = self.draw_tokens(data)
        got = self.tree.holders(tokens, ttl=ttl)
        assert list(got.items()) == list(self.model.holders(tokens, ttl=ttl).items())

    @rule(data=st.data())
    def lock_any(self, data: st.DataObject) -> None:
        pair = self.draw_node(data)
        if pair is not None:
            self.tree.lock(pair[0])
            self.model.lock(pair[1])
            self.locks.append(pair)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        mine, theirs = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(mine)
        self.model.unlock(theirs)

    @rule(n=st.integers(0, 8), tier=st.sampled_from(TIERS))
    def evict(self, n: int, tier: int) -> None:
        count, removed = self.tree.evict(n, tier)
        want_count, want_removed = self.model.evict(n, tier)
        assert (count, removed.tolist()) == (want_count, want_removed.tolist())

    @rule(tier=st.sampled_from(TIERS))
    def lru_leaf(self, tier: int) -> None:
        got, want = self.tree.lru_leaf(tier), self.model.lru_leaf(tier)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert path_of(got) == path_of(want)

    @rule(back=st.integers(0, 12))
    def expire(self, back: int) -> None:
        older_than = self.tree.clock() - back
        self.model.clock()
        assert self.tree.expire(older_than) == self.model.expire(older_than)

    @rule(holder=st.sampled_from(HOLDERS))
    def forget_holder(self, holder: Hashable) -> None:
        assert self.tree.remove_holder(holder) == self.model.remove_holder(holder)

    @rule(data=st.data(), holder=st.sampled_from(HOLDERS), keep=st.integers(-1, 10))
    def drop_holder_on_path(self, data: st.DataObject, holder: Hashable, keep: int) -> None:
        tokens = self.draw_tokens(data)
        got = self.tree.remove_holder(holder, tokens, keep_tokens=keep)
        assert got == self.model.remove_holder(holder, tokens, keep_tokens=keep)

    @rule(data=st.data())
    def split(self, data: st.DataObject) -> None:
        pair = self.draw_node(data)
        if pair is None:
            return
        mine, theirs = pair
        pages = data.draw(st.integers(0, len(theirs.key) // (4 * PAGE)))
        try:
            upper = self.tree.split(mine, pages)
        except InvalidRequest:
            with pytest.raises(InvalidRequest):
                self.model.split(theirs, pages)
            return
        want = self.model.split(theirs, pages)
        assert path_of(upper) == path_of(want)
        self.keep(upper, want)

    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def set_tier(self, data: st.DataObject, tier: int) -> None:
        pair = self.draw_node(data)
        if pair is not None:
            self.tree.set_tier(pair[0], tier)
            self.model.set_tier(pair[1], tier)

    @rule(data=st.data(), limit=st.booleans())
    def repoint(self, data: st.DataObject, limit: bool) -> None:
        addrs = sorted({a for n in self.model.nodes() for a in (n.value or ())})
        chosen = data.draw(st.lists(st.sampled_from(addrs), max_size=4)) if addrs else []
        moved = {a: 10_000 + a for a in chosen}
        if limit:
            mine, theirs = self.tree.nodes()[:3], list(self.model.nodes())[:3]
            assert self.tree.repoint(moved, mine) == self.model.repoint(moved, theirs)
        else:
            assert self.tree.repoint(moved) == self.model.repoint(moved)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        try:
            removed = self.tree.delete(tokens).tolist()
        except BlockInUse:
            with pytest.raises(BlockInUse):
                self.model.delete(tokens)
            return
        assert removed == self.model.delete(tokens).tolist()

    @rule(take=st.integers(0, 30))
    def lru_order(self, take: int) -> None:
        got = [path_of(n) for n in self.tree.lru_unlocked(take)]
        want = [path_of(n) for _, n in zip(range(take), self.model.lru_unlocked(), strict=False)]
        assert got == want

    @precondition(lambda self: self.next_addr % 7 == 0)  # now and then
    @rule()
    def reset(self) -> None:
        assert self.tree.reset().tolist() == self.model.reset().tolist()

    @invariant()
    def same_state(self) -> None:
        assert state(self.tree) == state(self.model)
        assert (self.tree.evictable_pages, self.tree.protected_pages) == (
            self.model.evictable_pages,
            self.model.protected_pages,
        )
        self.tree._check()

    @invariant()
    def handles_valid_exactly_while_their_node_lives(self) -> None:
        for mine, theirs in self.seen:
            if theirs.parent is None:
                assert mine == self.tree.root
            elif theirs.attached or theirs.lock_ref > 0:
                assert mine.valid and mine.attached == theirs.attached
                if theirs.attached:
                    assert path_of(mine) == path_of(theirs)
            else:
                assert not mine.valid
                with pytest.raises(InvalidRequest, match="stale tree node"):
                    _ = mine.key

    @invariant()
    def holders_are_not_kept_once_forgotten(self) -> None:
        held = {h for n in self.model.nodes() for h in (n.holders or ())}
        assert self.tree._known_holders == len(held)


TestNativeAgainstModel = NativeAgainstModel.TestCase
TestNativeAgainstModel.settings = settings(max_examples=200, stateful_step_count=100, deadline=None)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        ([], ValueError, "must not be empty"),
        (array("I"), ValueError, "must not be empty"),
        ([-1, 2], ValueError, r"0\.\.4294967295"),
        ([2**32, 1], ValueError, r"0\.\.4294967295"),
        ([2**70], ValueError, r"0\.\.4294967295"),
        (array("l", [1, -3]), ValueError, r"0\.\.4294967295"),
        (array("q", [2**32]), ValueError, r"0\.\.4294967295"),
        (array("d", [1.0, 2.0]), TypeError, "format 'd'"),
        ([1.5, 2.0], TypeError, "got float"),
        ([None], TypeError, "got NoneType"),
        ("abc", TypeError, "got str"),
        (b"\x00\x01", TypeError, "got bytes"),
        (memoryview(array("I", [1, 2])), TypeError, "got memoryview"),
        (42, TypeError, "got int"),
    ],
)
def test_bad_tokens_raise_and_change_nothing(tokens: object, error: type, message: str) -> None:
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([7, 8], [1, 2])
    for call in (
        lambda: tree.match(tokens),  # type: ignore[arg-type]
        lambda: tree.holders(tokens),  # type: ignore[arg-type]
        lambda: tree.insert(tokens, [1]),  # type: ignore[arg-type]
        lambda: tree.delete(tokens),  # type: ignore[arg-type]
        lambda: tree.remove_holder("a", tokens),  # type: ignore[arg-type]
    ):
        with pytest.raises(error, match=message):
            call()
    assert tree.num_pages == 2 and [s for s in tree.sequences()] == [((7, 8), [1, 2])]
    tree._check()


def test_token_inputs_of_every_int_kind_agree() -> None:
    """array('I') is read in place; other int arrays, lists, tuples and ranges are converted."""
    tree = RadixTree(page_size=2, slots_per_page=0)
    tree.insert(array("I", [1, 2, 3, 4]), holder="w")
    for tokens in (
        [1, 2, 3, 4],
        (1, 2, 3, 4),
        range(1, 5),
        array("l", [1, 2, 3, 4]),
        array("H", [1, 2, 3, 4]),
        array("Q", [1, 2, 3, 4]),
    ):
        assert tree.match(tokens).num_tokens == 4
    assert tree.holders([1, 2, 3, 4, 5]) == {"w": 4}
    assert tree.match([2**32 - 1, 1]).num_tokens == 0  # the largest id is fine


def test_partial_page_is_ignored_and_values_must_fit_whole_pages() -> None:
    """A partial last page is never cached; the addresses must cover the whole pages exactly."""
    tree = RadixTree(page_size=4, slots_per_page=2)
    assert tree.insert([1, 2, 3], []).new_tokens == 0  # no whole page
    with pytest.raises(ValueError, match="expected 2 addresses for 1 whole pages"):
        tree.insert([1, 2, 3, 4, 5], [1, 2, 3])
    with pytest.raises(ValueError, match="expected 0 addresses"):
        tree.insert([1, 2, 3], [1])
    with pytest.raises(TypeError, match="64-bit"):
        tree.insert([1, 2, 3, 4], [1, 2**64])
    with pytest.raises(TypeError, match="64-bit"):
        tree.insert([1, 2, 3, 4], [1, "x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="64-bit"):
        tree.insert([1, 2, 3, 4], array("d", [1.0, 2.0]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs one address"):
        tree.insert([1, 2, 3, 4])
    assert tree.num_pages == 0
    tree.insert([1, 2, 3, 4], array("Q", [5, 6]))
    node = tree.match([1, 2, 3, 4]).node
    with pytest.raises(ValueError, match="expected 2 addresses for 1 whole pages"):
        node.value = array("Q", [1])
    node.value = [8, 9]
    assert tree.match([1, 2, 3, 4]).value.tolist() == [8, 9]
    holders_only = RadixTree(page_size=4, slots_per_page=0)
    with pytest.raises(ValueError, match="stores no values"):
        holders_only.insert([1, 2, 3, 4], [1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"page_size": 2.0}, "page_size"),
        ({"page_size": 2**40}, "page_size"),
        ({"slots_per_page": -1}, "slots_per_page"),
    ],
)
def test_bad_tree_parameters_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RadixTree(**kwargs)


def test_bad_call_arguments_raise() -> None:
    tree = RadixTree(page_size=1, slots_per_page=0)
    tree.insert([1, 2, 3], holder="a")
    node = tree.match([1, 2, 3]).node
    for pages in (0, 3, -1):
        with pytest.raises(ValueError, match="cannot split an edge of 3 pages"):
            tree.split(node, pages)
    with pytest.raises(ValueError, match="root has no tier"):
        tree.set_tier(tree.root, 1)
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)
    with pytest.raises(TypeError):
        tree.insert([1, 2], holder=["unhashable"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tree.lock("not a node")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_pages"):
        tree.evict(True)
    tree._check()


def assert_stale(tree: RadixTree, node: TreeNode) -> None:
    for use in (
        lambda: node.key,
        lambda: node.value,
        lambda: node.children,
        lambda: tree.lock(node),
        lambda: tree.unlock(node),
        lambda: tree.split(node, 1),
        lambda: tree.set_tier(node, 1),
        lambda: tree.repoint({1: 2}, [node]),
    ):
        with pytest.raises(InvalidRequest, match="stale tree node"):
            use()


def test_stale_handle_raises_after_evict_delete_prune_and_reset() -> None:
    tree = RadixTree(page_size=1, slots_per_page=1, clock=Ticker())
    for gone in ("evict", "delete", "prune", "reset"):
        tree.insert([1, 2], [1, 2], holder="a")
        node = tree.match([1, 2]).node
        if gone == "evict":
            tree.evict(10)
        elif gone == "delete":
            tree.delete([1, 2])
        elif gone == "prune":
            tree.remove_holder("a")
        else:
            tree.reset()
        assert not node.valid
        tree.insert([5, 6], [5, 6])  # the freed slot is taken again: still not this handle
        assert_stale(tree, node)
        assert repr(node) == "<TreeNode stale>"
        tree.reset()
        tree._check()


def test_foreign_handle_raises() -> None:
    one, other = RadixTree(page_size=1), RadixTree(page_size=1)
    one.insert([1, 2], [1, 2])
    other.insert([1, 2], [1, 2])
    node = one.match([1, 2]).node
    assert node != other.match([1, 2]).node
    for use in (
        lambda: other.lock(node),
        lambda: other.unlock(node),
        lambda: other.split(node, 1),
        lambda: other.set_tier(node, 1),
        lambda: other.repoint({1: 2}, [node]),
    ):
        with pytest.raises(InvalidRequest, match="belongs to another tree"):
            use()
    assert other.protected_pages == 0 and one.protected_pages == 0


def test_a_node_detached_while_locked_stays_valid_until_its_last_unlock() -> None:
    """A locked request's node survives a reset as a detached node; the unlock still walks
    its old parents, and only then does the handle go stale."""
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([1, 2, 3], [1, 2, 3])
    node = tree.match([1, 2, 3], split=True).node
    tree.lock(node)
    assert tree.reset().tolist() == [1, 2, 3]
    assert node.valid and not node.attached and node.lock_ref == 1
    tree.unlock(node)
    assert not node.valid and tree.protected_pages == 0 and tree.evictable_pages == 0
    tree._check()


def test_handles_outlive_their_tree_safely() -> None:
    tree = RadixTree(page_size=1, slots_per_page=1)
    tree.insert([1, 2], [1, 2])
    node = tree.match([1, 2]).node
    del tree
    gc.collect()
    assert node.key == array("I", [1, 2]).tobytes() and node.value is not None


def test_clock_errors_propagate_and_change_nothing() -> None:
    def broken() -> float:
        raise RuntimeError("clock down")

    tree = RadixTree(page_size=1, slots_per_page=0, clock=broken)
    with pytest.raises(RuntimeError, match="clock down"):
        tree.insert([1, 2], holder="a")
    assert tree.num_pages == 0 and tree._known_holders == 0
    with pytest.raises(TypeError, match="callable"):
        RadixTree(clock=3)  # type: ignore[arg-type]


def test_bad_input_is_typed_as_the_pool_errors() -> None:
    """The refusals are mempool.errors' classes (callers catch InvalidRequest, BlockInUse)."""
    tree = RadixTree(page_size=1, slots_per_page=1)
    with pytest.raises(InvalidTokens):
        tree.match("x")  # type: ignore[arg-type]
    tree.insert([1], [1])
    tree.lock(tree.match([1]).node)
    with pytest.raises(BlockInUse):
        tree.delete([1])


def test_wide_nodes_find_children_through_their_index() -> None:
    """Past a few children a node looks them up by hash (the character tree's root has
    hundreds); adding, splitting under and removing them keeps every lookup right."""
    tree = RadixTree(page_size=1, slots_per_page=0, clock=Ticker())
    model = radix_model.RadixTree(page_size=1, slots_per_page=0, clock=Ticker())
    for t in (tree, model):
        for c in range(300):
            t.insert([c, c + 1, c + 2], holder=c % 3)
        for c in range(0, 300, 2):
            t.remove_holder(c % 3, [c, c + 1, c + 2], keep_tokens=1)  # splits under c
        for c in range(0, 300, 3):
            t.delete([c, c + 1, c + 2])
    tree._check()
    assert state(tree) == state(model)
    for c in range(302):
        query = [c, c + 1, c + 2, 7]
        assert tree.match(query).num_tokens == model.match(query).num_tokens
        assert tree.holders(query) == model.holders(query)


def test_a_prompt_parting_from_a_long_edge_matches_every_whole_page_before() -> None:
    """A long edge is compared a block of pages at a time: a prompt that parts from it at any
    token (inside a block, at a block's edge, in the last page, or running past it) matches
    the whole pages before that token, in match, holders and the split an insert makes."""
    page, pages = 4, 70  # more than two blocks of kComparedPages (32)
    edge = list(range(1000, 1000 + page * pages))
    for part in (*range(page, 40 * page), *range(60 * page, page * pages + 1)):
        query = [*edge[:part], 7, 7, 7, 7, 7]
        tree = RadixTree(page_size=page, slots_per_page=0, clock=Ticker())
        model = radix_model.RadixTree(page_size=page, slots_per_page=0, clock=Ticker())
        for t in (tree, model):
            t.insert(edge, holder="a")
        assert tree.match(query).num_tokens == model.match(query).num_tokens == part // page * page
        assert tree.holders(query) == model.holders(query)
        for t in (tree, model):
            t.insert(query, holder="b")
        tree._check()
        assert state(tree) == state(model)
