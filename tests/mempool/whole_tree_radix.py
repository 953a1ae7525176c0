"""The radix tree's previous whole-tree algorithms, kept only as the tests' reference.

`evict` heapifies every unlocked leaf on each call, `expire` and `remove_holder(holder)` visit
every node, and pruning walks the whole tree: slow, but obviously what the semantics say.
`mempool.radix.RadixTree` (native) and its Python model (radix_model.py) keep the same
answers incrementally; the property test in
test_radix_incremental.py drives both with the same operations and compares every result.

One deliberate difference from the old code: locking or unlocking a node that is no longer in
the tree (pruned or reset while locked) leaves the page counts alone; the old code counted
such a node's pages again and drove `protected_pages` negative.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence

from mempool.errors import BlockInUse, InvalidRequest, InvalidTokens
from mempool.radix import as_token_bytes, tree_pretty
from tests.mempool.radix_model import TOKEN_BYTES, InsertResult, Match, Tokens, TreeNode


class WholeTreeRadix:
    """Same public API and node shapes as RadixTree; every maintenance call scans the tree."""

    def __init__(
        self, page_size: int = 16, slots_per_page: int = 1, clock: Callable[[], float] = time.time
    ) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.stride = slots_per_page
        self.clock = clock
        self.root = TreeNode(lock_ref=1)
        self.evictable_pages = 0
        self.protected_pages = 0

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def match(self, tokens: Tokens, ttl: float | None = None, split: bool = False) -> Match:
        key = self._page_key(tokens)
        now = self.clock()
        cutoff = None if ttl is None else now - ttl
        end, pos = self._descend(key, split=split, now=now)
        path = []
        walk: TreeNode | None = end
        while walk is not None and walk is not self.root:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        value = array("Q")
        holder_tokens: dict[Hashable, int] = {}
        depth = 0
        for step in path:
            depth = min(depth + len(step.key), pos)
            if step.value is not None:
                value.extend(step.value[: depth // self.page_bytes * self.stride - len(value)])
            if step.holders:
                for holder, seen in step.holders.items():
                    if cutoff is None or seen >= cutoff:
                        holder_tokens[holder] = depth // TOKEN_BYTES
        node = path[-1].parent if path and depth < self._depth(path[-1]) else end
        return Match(pos // TOKEN_BYTES, value, node or self.root, holder_tokens)

    def insert(
        self, tokens: Tokens, value: Sequence[int] | None = None, holder: Hashable | None = None
    ) -> InsertResult:
        key = self._page_key(tokens)
        pages = len(key) // self.page_bytes
        values = None if value is None else array("Q", value)
        if self.stride and (values is None or len(values) != pages * self.stride):
            raise InvalidRequest("wrong number of addresses")
        now = self.clock()
        pb, stride = self.page_bytes, self.stride
        node, pos, existing = self.root, 0, 0
        duplicates: list[int] = []
        while pos < len(key):
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                leaf_value = None if values is None else values[pos // pb * stride :]
                leaf = TreeNode(key[pos:], leaf_value, node, last_access=now)
                if holder is not None:
                    leaf.holders = {holder: now}
                node.children[key[pos : pos + pb]] = leaf
                self.evictable_pages += (len(key) - pos) // pb
                node = leaf
                break
            if not key.startswith(child.key, pos):
                child = self._split(child, self._common_pages(child.key, key, pos))
            span = len(child.key) // pb
            if values is not None and child.value is not None:
                given = values[pos // pb * stride : (pos // pb + span) * stride]
                if given != child.value:
                    duplicates.extend(g for g, c in zip(given, child.value, strict=True) if g != c)
            child.last_access = now
            if holder is not None:
                if child.holders is None:
                    child.holders = {}
                child.holders[holder] = now
            existing += span
            pos += len(child.key)
            node = child
        ps = self.page_size
        return InsertResult(existing * ps, pages * ps - existing * ps, duplicates, node)

    def delete(self, tokens: Tokens) -> array:
        key = self._page_key(tokens)
        node, pos = self._descend(key, split=False, now=None)
        removed = array("Q")
        if node is self.root or node.children or pos < self._depth(node):
            return removed
        chain = [node]
        while (parent := chain[-1].parent) is not self.root and parent is not None:
            if len(parent.children) != 1:
                break
            chain.append(parent)
        if any(n.lock_ref for n in chain):
            raise BlockInUse("locked")
        for n in chain:
            self._detach(n, removed)
        return removed

    def evict(self, num_pages: int) -> tuple[int, array]:
        # (last_access, tiebreak, node): the clock never repeats among leaves in the tests
        heap = [
            (n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        removed_pages, removed = 0, array("Q")
        while heap and removed_pages < num_pages:
            _, _, leaf = heapq.heappop(heap)
            removed_pages += len(leaf.key) // self.page_bytes
            parent = leaf.parent
            assert parent is not None
            self._detach(leaf, removed)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return removed_pages, removed

    def lock(self, node: TreeNode) -> None:
        attached = self._attached(node)
        while node is not self.root and node.parent is not None:
            if node.lock_ref == 0 and attached(node):
                pages = len(node.key) // self.page_bytes
                self.evictable_pages -= pages
                self.protected_pages += pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        walk: TreeNode | None = node
        while walk is not None and walk is not self.root:
            if walk.lock_ref <= 0:
                raise InvalidRequest("unlock of a node that is not locked")
            walk = walk.parent
        attached = self._attached(node)
        while node is not self.root and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and attached(node):
                pages = len(node.key) // self.page_bytes
                self.evictable_pages += pages
                self.protected_pages -= pages
            node = node.parent

    def remove_holder(
        self, holder: Hashable, tokens: Tokens | None = None, keep_tokens: int = 0
    ) -> int:
        if tokens is None:
            for node in list(self.nodes()):
                if node.holders:
                    node.holders.pop(holder, None)
            return self._prune_unheld()
        key = self._page_key(tokens)
        keep = max(keep_tokens, 0) // self.page_size * self.page_bytes
        node, pos = self._descend(key[:keep], split=True, now=None)
        nxt = node.children.get(key[pos : pos + self.page_bytes]) if pos == keep else None
        if nxt is None:
            return 0
        for sub in self._nodes(nxt):
            if sub.holders:
                sub.holders.pop(holder, None)
        return self._prune_unheld()

    def expire(self, older_than: float) -> int:
        for node in self.nodes():
            if node.holders:
                for h in [h for h, seen in node.holders.items() if seen < older_than]:
                    del node.holders[h]
        return self._prune_unheld()

    def lru_unlocked(self) -> Iterator[TreeNode]:
        """Unlocked nodes by repeatedly taking the least recently used one left without
        children left: eviction's order, found by scanning everything each step."""
        left = [n for n in self.nodes() if n.lock_ref == 0]
        taken: set[int] = set()
        while left:
            ready = [n for n in left if all(id(c) in taken for c in n.children.values())]
            best = min(ready, key=lambda n: n.last_access)
            left.remove(best)
            taken.add(id(best))
            yield best

    def reset(self) -> array:
        removed = array("Q")
        for node in self.nodes():
            if node.value is not None:
                removed.extend(node.value)
        self.root.children.clear()
        self.evictable_pages = self.protected_pages = 0
        return removed

    def nodes(self) -> Iterator[TreeNode]:
        return self._nodes()

    def pretty(self) -> str:
        return tree_pretty(self)

    # helpers, as in the old code

    def _attached(self, start: TreeNode) -> Callable[[TreeNode], bool]:
        """Whether each node on `start`'s path to the root is still linked into the tree."""
        linked: dict[int, bool] = {}
        ok = True
        path = []
        walk = start
        while walk is not self.root and walk.parent is not None:
            path.append(walk)
            walk = walk.parent
        for node in reversed(path):  # from the top: a node is linked if its parent is
            parent = node.parent
            assert parent is not None
            ok = ok and parent.children.get(node.key[: self.page_bytes]) is node
            linked[id(node)] = ok
        return lambda node: linked[id(node)]

    def _page_key(self, tokens: Tokens) -> bytes:
        if isinstance(tokens, str):
            raise InvalidTokens("tokens must be ints")
        key = as_token_bytes(tokens)
        return key[: len(key) - len(key) % self.page_bytes]

    def _descend(self, key: bytes, split: bool, now: float | None) -> tuple[TreeNode, int]:
        node, pos, pb = self.root, 0, self.page_bytes
        while pos < len(key):
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            if not key.startswith(child.key, pos):
                pages = self._common_pages(child.key, key, pos)
                if not split:
                    return child, pos + pages * pb
                child = self._split(child, pages)
            if now is not None:
                child.last_access = now
            pos += len(child.key)
            node = child
        return node, pos

    def _depth(self, node: TreeNode) -> int:
        depth = 0
        walk: TreeNode | None = node
        while walk is not None and walk is not self.root:
            depth += len(walk.key)
            walk = walk.parent
        return depth

    def _common_pages(self, edge: bytes, key: bytes, pos: int) -> int:
        pb = self.page_bytes
        lo, hi = 1, min(len(edge), len(key) - pos) // pb
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(edge[: mid * pb], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, child: TreeNode, pages: int) -> TreeNode:
        pb, cut = self.page_bytes, pages * self.page_bytes
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            child.key[:cut],
            None if child.value is None else child.value[: pages * self.stride],
            parent,
            {child.key[cut : cut + pb]: child},
            None if child.holders is None else dict(child.holders),
            child.lock_ref,
            child.last_access,
        )
        parent.children[child.key[:pb]] = upper
        child.key = child.key[cut:]
        if child.value is not None:
            child.value = child.value[pages * self.stride :]
        child.parent = upper
        return upper

    def _detach(self, node: TreeNode, removed: array) -> None:
        assert node.parent is not None
        del node.parent.children[node.key[: self.page_bytes]]
        for sub in self._nodes(node):
            pages = len(sub.key) // self.page_bytes
            if sub.lock_ref:
                self.protected_pages -= pages
            else:
                self.evictable_pages -= pages
            if sub.value is not None:
                removed.extend(sub.value)

    def _prune_unheld(self) -> int:
        pruned, dropped = 0, array("Q")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.holders is not None and not node.holders:
                pruned += sum(len(s.key) for s in self._nodes(node)) // self.page_bytes
                self._detach(node, dropped)
            else:
                stack.extend(node.children.values())
        return pruned

    def _nodes(self, start: TreeNode | None = None) -> Iterator[TreeNode]:
        stack = [start] if start is not None else list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
