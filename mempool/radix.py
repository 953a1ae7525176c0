"""Radix tree over token pages: MemPool's local index and the router's global prompt trees.

One tree type serves both uses (MemServe 4.2 and 6): a node's `value` holds the addresses of
its pages' KV blocks (the local index; an address names its tier and instance), and its
`holders` maps each instance known to hold the pages to when that was last confirmed (the
global trees, whose entries expire). Keys are whole pages of token ids, stored as uint32 bytes
so that comparing and slicing run at C speed; a partial page never matches.

Public API: `match`, `insert`, `delete`, `evict`, `lock`/`unlock`, `remove_holder`, `expire`.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from mempool.errors import BlockInUse, InvalidRequest, InvalidTokens

TOKEN_BYTES = 4  # token ids are stored as uint32
Tokens = Sequence[int] | array


def token_array(tokens: Tokens) -> array:
    """Token ids as a uint32 array (converted once per call); clear errors for bad input."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        data = tokens
    elif isinstance(tokens, str | bytes | bytearray | memoryview):
        raise InvalidTokens(
            f"tokens must be a sequence of int token ids, got {type(tokens).__name__}"
        )
    else:
        try:
            data = array("I", tokens)
        except TypeError as exc:
            raise InvalidTokens(f"tokens must be a sequence of int token ids: {exc}") from None
        except OverflowError:
            raise InvalidRequest("token ids must lie in 0..4294967295") from None
    if not data:
        raise InvalidRequest("tokens must not be empty")
    return data


def as_token_bytes(tokens: Tokens) -> bytes:
    """Token ids as uint32 bytes, the tree's key form."""
    return token_array(tokens).tobytes()


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge of the tree: a run of whole pages, what holds them and who may evict them."""

    key: bytes = b""
    value: array | None = None  # slots_per_page block addresses per page (local index)
    parent: TreeNode | None = None
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    holders: dict[Hashable, float] | None = None  # instance -> last confirmed (global trees)
    lock_ref: int = 0
    last_access: float = 0.0

    def __lt__(self, other: TreeNode) -> bool:  # for the eviction heap
        return self.last_access < other.last_access


@dataclass(slots=True)
class Match:
    """Result of `match`: the longest cached prefix and, per holder, how much of it each holds."""

    num_tokens: int
    value: array
    node: TreeNode
    holder_tokens: dict[Hashable, int]


@dataclass(slots=True)
class InsertResult:
    """`existing_tokens` were cached already; `duplicates` are given addresses not adopted."""

    existing_tokens: int
    new_tokens: int
    duplicates: list[int]
    node: TreeNode


class RadixTree:
    """Page radix tree. `slots_per_page` addresses are stored per page (0: a holders-only tree)."""

    def __init__(
        self,
        page_size: int = 16,
        slots_per_page: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidRequest(f"page_size must be a positive int, got {page_size!r}")
        if slots_per_page < 0:
            raise InvalidRequest(f"slots_per_page must be >= 0, got {slots_per_page}")
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.stride = slots_per_page
        self.clock = clock
        self.root = TreeNode(lock_ref=1)
        self.evictable_pages = 0
        self.protected_pages = 0

    # ----------------------------------------------------------------- public API

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def match(self, tokens: Tokens, ttl: float | None = None, split: bool = False) -> Match:
        """Longest cached page-aligned prefix of `tokens`.

        With `split`, a match ending inside an edge splits it so that `node` ends exactly at
        the match (needed to `lock` it); without, the tree is left as it is and `node` is the
        deepest node the match covers whole. With `ttl`, holders not confirmed within the
        last `ttl` seconds are ignored.
        """
        key = self._page_key(tokens)
        now = self.clock()
        cutoff = None if ttl is None else now - ttl
        end, pos = self._descend(key, split=split, now=now)
        path = []
        walk = end
        while walk is not self.root:
            path.append(walk)
            walk = walk.parent  # type: ignore[assignment]
        path.reverse()
        value = array("Q")
        holder_tokens: dict[Hashable, int] = {}
        depth = 0
        for step in path:
            depth = min(depth + len(step.key), pos)  # the last step may be covered in part
            if step.value is not None:
                value.extend(step.value[: depth // self.page_bytes * self.stride - len(value)])
            if step.holders:
                tokens_here = depth // TOKEN_BYTES
                for holder, seen in step.holders.items():
                    if cutoff is None or seen >= cutoff:
                        holder_tokens[holder] = tokens_here
        node = path[-1].parent if path and depth < self._depth(path[-1]) else end
        return Match(pos // TOKEN_BYTES, value, node or self.root, holder_tokens)

    def insert(
        self,
        tokens: Tokens,
        value: Sequence[int] | array | None = None,
        holder: Hashable | None = None,
    ) -> InsertResult:
        """Add the whole pages of `tokens`; existing pages keep their value.

        `value` must hold slots_per_page addresses per whole page. Addresses given for pages
        that were cached already and differ from the cached ones come back as `duplicates`.
        With `holder`, every node on the path records it as holding the pages now.
        """
        key = self._page_key(tokens)
        pages = len(key) // self.page_bytes
        values = self._check_value(value, pages)
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
        """Drop the cached pages of `tokens` that no other cached sequence shares.

        Pages still shared with another cached sequence, including a longer one that extends
        this prompt, are kept. Returns the removed pages' values. Raises BlockInUse (and
        removes nothing) when a page to remove is locked by a running request.
        """
        key = self._page_key(tokens)
        node, pos = self._descend(key, split=False, now=None)
        removed = array("Q")
        if node is self.root or node.children or self._ends_inside(node, pos):
            return removed
        chain = [node]
        while (parent := chain[-1].parent) is not self.root and len(parent.children) == 1:  # type: ignore[union-attr]
            chain.append(parent)  # type: ignore[arg-type]
        if any(n.lock_ref for n in chain):
            raise BlockInUse("cannot delete: part of this prompt's cache is locked by a request")
        for n in chain:
            self._detach(n, removed)
        return removed

    def evict(self, num_pages: int) -> tuple[int, array]:
        """Remove least-recently-used unlocked leaves until `num_pages` pages are gone.

        Returns (pages removed, their values). Locked nodes and their ancestors stay.
        """
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        removed_pages, removed = 0, array("Q")
        while heap and removed_pages < num_pages:
            leaf = heapq.heappop(heap)
            removed_pages += len(leaf.key) // self.page_bytes
            parent = leaf.parent
            self._detach(leaf, removed)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:  # type: ignore[union-attr]
                heapq.heappush(heap, parent)  # type: ignore[arg-type]
        return removed_pages, removed

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction and deletion (a running request)."""
        while node is not self.root:
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_bytes
                self.evictable_pages -= pages
                self.protected_pages += pages
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock`; ValueError if the node is not locked."""
        walk = node
        while walk is not self.root:
            if walk.lock_ref <= 0:
                raise InvalidRequest("unlock of a node that is not locked")
            walk = walk.parent  # type: ignore[assignment]
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                pages = len(node.key) // self.page_bytes
                self.evictable_pages += pages
                self.protected_pages -= pages
            node = node.parent  # type: ignore[assignment]

    def remove_holder(
        self, holder: Hashable, tokens: Tokens | None = None, keep_tokens: int = 0
    ) -> int:
        """Forget that `holder` holds pages; returns the pages pruned from the tree.

        Without `tokens`: everywhere (a removed or dead instance). With `tokens`: on that
        prompt's path beyond its first `keep_tokens` tokens and below (the instance reported
        holding only that much). Nodes left with no holder are pruned.
        """
        if tokens is None:
            for node in list(self._nodes()):
                if node.holders:
                    node.holders.pop(holder, None)
            return self._prune_unheld()
        key = self._page_key(tokens)
        keep = max(keep_tokens, 0) // self.page_size * self.page_bytes
        node, pos = self._descend(key[:keep], split=True, now=None)
        # The holder lacks the page after `keep`, so (prefix closure) everything below it too.
        nxt = node.children.get(key[pos : pos + self.page_bytes]) if pos == keep else None
        if nxt is None:
            return 0
        for sub in self._nodes(nxt):
            if sub.holders:
                sub.holders.pop(holder, None)
        return self._prune_unheld()

    def expire(self, older_than: float) -> int:
        """Drop holder entries last confirmed before `older_than`; returns pages pruned."""
        for node in self._nodes():
            if node.holders:
                stale = [h for h, seen in node.holders.items() if seen < older_than]
                for h in stale:
                    del node.holders[h]
        return self._prune_unheld()

    def reset(self) -> array:
        """Empty the tree (locked entries included); returns every value it held."""
        removed = array("Q")
        for node in self._nodes():
            if node.value is not None:
                removed.extend(node.value)
        self.root.children.clear()
        self.evictable_pages = self.protected_pages = 0
        return removed

    def pretty(self) -> str:
        """Indented dump: pages, lock count, holders; for debugging and tests."""
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                pages = len(child.key) // self.page_bytes
                holders = sorted(map(str, child.holders)) if child.holders else []
                lines.append(f"{'  ' * depth}[{pages}p lock={child.lock_ref}] {holders}")
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)

    def sequences(self) -> Iterator[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf sequence of tokens with its values (tests and debugging)."""

        def visit(node: TreeNode, tokens: tuple[int, ...], vals: list[int]):
            if not node.children and node is not self.root:
                yield tokens, vals
            for child in node.children.values():
                yield from visit(
                    child,
                    tokens + tuple(array("I", child.key)),
                    vals + (list(child.value) if child.value is not None else []),
                )

        yield from visit(self.root, (), [])

    # ----------------------------------------------------------------- helpers

    def _page_key(self, tokens: Tokens) -> bytes:
        key = as_token_bytes(tokens)
        return key[: len(key) - len(key) % self.page_bytes]

    def _check_value(self, value: Sequence[int] | array | None, pages: int) -> array | None:
        if self.stride == 0:
            if value is not None:
                raise InvalidRequest("this tree stores no values (slots_per_page=0)")
            return None
        if value is None:
            raise InvalidRequest("insert needs one address list entry per page slot")
        if len(value) != pages * self.stride:
            raise InvalidRequest(
                f"expected {pages * self.stride} addresses for {pages} whole pages "
                f"({self.stride} per page), got {len(value)}"
            )
        if isinstance(value, array) and value.typecode == "Q":
            return value
        try:
            return array("Q", value)
        except (TypeError, OverflowError) as exc:
            raise InvalidTokens(f"addresses must be 64-bit unsigned ints: {exc}") from None

    def _descend(self, key: bytes, split: bool, now: float | None) -> tuple[TreeNode, int]:
        """Walk `key` down; returns the deepest fully matched node and the bytes matched.

        With `split`, a match ending inside an edge splits it so the returned node ends there.
        """
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

    def _ends_inside(self, node: TreeNode, pos: int) -> bool:
        """True when `pos` (a non-split descent's end) falls inside `node`'s edge."""
        return pos < self._depth(node)

    def _depth(self, node: TreeNode) -> int:
        """Key bytes from the root to the end of `node`."""
        depth = 0
        while node is not self.root:
            depth += len(node.key)
            node = node.parent  # type: ignore[assignment]
        return depth

    def _common_pages(self, edge: bytes, key: bytes, pos: int) -> int:
        """Whole pages `edge` shares with key[pos:] (at least 1: the first page matched)."""
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
        """Cut `child` after `pages` pages; returns the new upper node."""
        pb, cut = self.page_bytes, pages * self.page_bytes
        upper = TreeNode(
            child.key[:cut],
            None if child.value is None else child.value[: pages * self.stride],
            child.parent,
            {child.key[cut : cut + pb]: child},
            None if child.holders is None else dict(child.holders),
            child.lock_ref,
            child.last_access,
        )
        child.parent.children[child.key[:pb]] = upper  # type: ignore[union-attr]
        child.key = child.key[cut:]
        if child.value is not None:
            child.value = child.value[pages * self.stride :]
        child.parent = upper
        return upper

    def _detach(self, node: TreeNode, removed: array) -> None:
        """Remove `node` and its subtree, collecting values and fixing the page counts."""
        del node.parent.children[node.key[: self.page_bytes]]  # type: ignore[union-attr]
        for sub in self._nodes(node):
            pages = len(sub.key) // self.page_bytes
            if sub.lock_ref:
                self.protected_pages -= pages
            else:
                self.evictable_pages -= pages
            if sub.value is not None:
                removed.extend(sub.value)

    def _prune_unheld(self) -> int:
        """Detach every node no holder holds any more (holders-tracking trees)."""
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
        """Every node below and including `start` (default: all but the root), parents first."""
        stack = [start] if start is not None else list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
