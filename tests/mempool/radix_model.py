"""The Python page radix tree that served until the native one (mempool._radix): the tests'
reference model. test_radix_native.py drives both with the same random operations and
compares every result; the native code follows these algorithms step for step.

One tree type serves both uses (MemServe 4.2 and 6): a node's `value` holds the addresses of
its pages' KV blocks (the local index; an address names its tier and instance), and its
`holders` maps each instance known to hold the pages to when that was last confirmed (the
global trees, whose entries expire). Keys are whole pages of token ids, stored as uint32 bytes
so that comparing and slicing run at C speed; a partial page never matches.

Eviction and expiry run on every allocation that falls short and on every router tick, so
their cost must follow what they remove, not the size of the tree. The tree therefore keeps,
incrementally, what a whole-tree walk would otherwise recompute on every call:

- the evictable leaves (unlocked, childless) in a lazy min-heap by `last_access`, as SGLang's
  radix cache keeps its evictable leaves. An entry is current while its stamp equals the
  node's `lru_stamp`; locking, growing or detaching a leaf clears the stamp, and stale entries
  are skipped when popped and dropped when they outnumber the rest. Touching a leaf (match,
  insert) changes nothing in the heap: its entry's time becomes a lower bound, and a popped
  entry older than its node's `last_access` is re-entered at that time instead (the clock
  never goes back), so lookups pay nothing for eviction order;
- every (node, holder, last confirmed) in a lazy min-heap by time, as NVIDIA Dynamo's expiry
  queue; an entry is current while the node is attached and still maps the holder to that time;
- per holder, the set of nodes it holds, so forgetting an instance touches only its nodes.

Tiers (MemPool with a device and a host tier): a node's `tier` says where its pages live,
lower numbers faster. A node is a *tier leaf* when it is unlocked and no child sits in the same
or a faster tier; each tier keeps its own heap of tier leaves, so the least recently used
device pages whose children are all on the host (`lru_leaf(device)`: the next to swap out) and
the least recently used host leaves (`evict(n, host)`: the next to drop) are found at the cost
of what they take, however many pages the other tier holds. A tree whose nodes all keep tier 0
(the router's trees, a one-tier pool) has one heap and leaves as before.

Public API: `match`, `insert`, `delete`, `evict`, `lock`/`unlock`, `remove_holder`, `expire`,
`lru_leaf`, `set_tier`, `split`, `lru_unlocked` and `repoint` (swapping between tiers),
`reset`, `nodes`, `pretty`, `sequences`.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from mempool.errors import BlockInUse, InvalidRequest, InvalidTokens
from mempool.radix import as_token_bytes, tree_pretty, tree_sequences

TOKEN_BYTES = 4  # token ids are stored as uint32
Tokens: TypeAlias = "Sequence[int] | array[int]"
# A heap is compacted when its stale entries outnumber the current ones by this factor
# (plus a floor), so the work of dropping them is paid for by the pushes that made them.
STALE_FACTOR = 2
STALE_FLOOR = 64


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge of the tree: a run of whole pages, what holds them and who may evict them."""

    key: bytes = b""
    value: array[int] | None = None  # slots_per_page block addresses per page (local index)
    parent: TreeNode | None = None
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    holders: dict[Hashable, float] | None = None  # instance -> last confirmed (global trees)
    lock_ref: int = 0
    last_access: float = 0.0
    attached: bool = True  # False once evicted, deleted, pruned or reset out of the tree
    lru_stamp: int = 0  # stamp of its current entry in the evictable-leaf heap; 0: none
    tier: int = 0  # where its pages live (MemPool: the MemType value); lower is faster


@dataclass(slots=True)
class Match:
    """Result of `match`: the longest cached prefix and, per holder, how much of it each holds."""

    num_tokens: int
    value: array[int]
    node: TreeNode
    holder_tokens: dict[Hashable, int]


@dataclass(slots=True)
class InsertResult:
    """`existing_tokens` were cached already; `duplicates` are given addresses not adopted."""

    existing_tokens: int
    new_tokens: int
    duplicates: list[int]
    node: TreeNode


# (last_access when queued, stamp, leaf): the stamp is unique, so nodes are never compared.
LeafEntry: TypeAlias = tuple[float, int, TreeNode]
# (confirmed at or before, sequence number, node, holder): one per (node, holder) pair, pushed
# when the holder arrives and re-keyed lazily by expire(), so a confirmation is a dict store
ExpiryEntry: TypeAlias = tuple[float, int, TreeNode, Hashable]


class RadixTree:
    """Page radix tree. `slots_per_page` addresses are stored per page (0: a holders-only tree).

    `clock` must never go backwards (the LRU order relies on it); time.monotonic by default.
    """

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
        self._seq = 0  # stamps and expiry sequence numbers; 0 means "none"
        self._leaves: list[LeafEntry] = []  # tier 0's tier leaves
        self._tier_leaves: dict[int, list[LeafEntry]] = {}  # other tiers' tier leaves
        self._queued_leaves = 0  # nodes with a current entry in one of the heaps
        self._tiered = False  # some node was ever given a tier other than 0
        self._expiry: list[ExpiryEntry] = []
        self._holder_entries = 0  # (attached node, holder) pairs: the current expiry entries
        self._by_holder: dict[Hashable, set[TreeNode]] = {}

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
        while walk.parent is not None:  # only the root has none
            path.append(walk)
            walk = walk.parent
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

    def holders(self, tokens: Tokens, ttl: float | None = None) -> dict[Hashable, int]:
        """`match(tokens, ttl).holder_tokens` in one walk down: the router's per-request
        lookup, which needs neither the values nor the deepest node."""
        key = self._page_key(tokens)
        now = self.clock()
        cutoff = float("-inf") if ttl is None else now - ttl
        holder_tokens: dict[Hashable, int] = {}
        node, pos, pb, end = self.root, 0, self.page_bytes, len(key)
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            whole = key.startswith(child.key, pos)
            if whole:
                child.last_access = now
                pos += len(child.key)
            else:  # the match ends inside this edge
                pos += self._common_pages(child.key, key, pos) * pb
            if child.holders:
                tokens_here = pos // TOKEN_BYTES
                for holder, seen in child.holders.items():
                    if seen >= cutoff:
                        holder_tokens[holder] = tokens_here
            if not whole:
                break
            node = child
        return holder_tokens

    def insert(
        self,
        tokens: Tokens,
        value: Sequence[int] | array[int] | None = None,
        holder: Hashable | None = None,
        tier: int = 0,
    ) -> InsertResult:
        """Add the whole pages of `tokens`; existing pages keep their value.

        `value` must hold slots_per_page addresses per whole page. Addresses given for pages
        that were cached already and differ from the cached ones come back as `duplicates`.
        With `holder`, every node on the path records it as holding the pages now. New pages
        go into one new leaf in `tier`.
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
                if tier <= node.tier:
                    self._unqueue_leaf(node)  # a tier leaf until now, it gets a child
                leaf_value = None if values is None else values[pos // pb * stride :]
                leaf = TreeNode(key[pos:], leaf_value, node, last_access=now, tier=tier)
                self._tiered = self._tiered or tier != 0
                node.children[key[pos : pos + pb]] = leaf
                self.evictable_pages += (len(key) - pos) // pb
                self._queue_leaf(leaf)
                if holder is not None:
                    leaf.holders = {}
                    self._confirm(leaf, holder, now)
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
                self._confirm(child, holder, now)
            existing += span
            pos += len(child.key)
            node = child
        if holder is not None:
            self._compact_expiry_if_stale()
        ps = self.page_size
        return InsertResult(existing * ps, pages * ps - existing * ps, duplicates, node)

    def delete(self, tokens: Tokens) -> array[int]:
        """Drop the cached pages of `tokens` that no other cached sequence shares.

        Pages still shared with another cached sequence, including a longer one that extends
        this prompt, are kept. Returns the removed pages' values. Raises BlockInUse (and
        removes nothing) when a page to remove is locked by a running request.
        """
        key = self._page_key(tokens)
        node, pos = self._descend(key, split=False, now=None)
        removed: array[int] = array("Q")
        if node is self.root or node.children or self._ends_inside(node, pos):
            return removed
        chain = [node]
        while (parent := self._parent(chain[-1])) is not self.root and len(parent.children) == 1:
            chain.append(parent)
        if any(n.lock_ref for n in chain):
            raise BlockInUse("cannot delete: part of this prompt's cache is locked by a request")
        for n in chain:  # the leaf first: values come back deepest page first
            self._detach(n, removed)
        return removed

    def evict(self, num_pages: int, tier: int = 0) -> tuple[int, array[int]]:
        """Remove least-recently-used unlocked leaves until `num_pages` pages are gone.

        Returns (pages removed, their values). Locked nodes and their ancestors stay. A parent
        left childless joins the evictable leaves, so a long idle branch goes leaf by leaf.
        In a tiered tree only tier leaves of `tier` go, each with its subtree (in slower
        tiers): evicting the slowest tier drops true leaves only.
        """
        removed_pages, removed = 0, array("Q")
        while removed_pages < num_pages:
            leaf = self._pop_lru_leaf(tier)
            if leaf is None:
                break
            removed_pages += self._detach(leaf, removed)
        return removed_pages, removed

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction and deletion (a running request)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._unqueue_leaf(node)
                if node.attached:
                    pages = len(node.key) // self.page_bytes
                    self.evictable_pages -= pages
                    self.protected_pages += pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock`; ValueError if the node is not locked."""
        walk = node
        while walk.parent is not None:
            if walk.lock_ref <= 0:
                raise InvalidRequest("unlock of a node that is not locked")
            walk = walk.parent
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.attached:
                pages = len(node.key) // self.page_bytes
                self.evictable_pages += pages
                self.protected_pages -= pages
                if self._is_tier_leaf(node):
                    self._queue_leaf(node)
            node = node.parent

    def remove_holder(
        self, holder: Hashable, tokens: Tokens | None = None, keep_tokens: int = 0
    ) -> int:
        """Forget that `holder` holds pages; returns the pages pruned from the tree.

        Without `tokens`: everywhere (a removed or dead instance). With `tokens`: on that
        prompt's path beyond its first `keep_tokens` tokens and below (the instance reported
        holding only that much). Nodes left with no holder are pruned, with their subtrees.
        """
        emptied: list[TreeNode] = []
        if tokens is None:
            held = self._by_holder.pop(holder, set())
            for node in held:
                holders = node.holders
                assert holders is not None  # indexed because it has holders
                del holders[holder]
                if not holders:
                    emptied.append(node)
            self._holder_entries -= len(held)
            self._compact_expiry_if_stale()
            return self._prune(emptied)
        key = self._page_key(tokens)
        keep = max(keep_tokens, 0) // self.page_size * self.page_bytes
        node, pos = self._descend(key[:keep], split=True, now=None)
        # The holder lacks the page after `keep`, so (prefix closure) everything below it too.
        nxt = node.children.get(key[pos : pos + self.page_bytes]) if pos == keep else None
        if nxt is None:
            return 0
        for sub in self._nodes(nxt):
            if sub.holders and holder in sub.holders:
                self._drop_holder(sub, holder)
                if not sub.holders:
                    emptied.append(sub)
        self._compact_expiry_if_stale()
        return self._prune(emptied)

    def expire(self, older_than: float) -> int:
        """Drop holder entries last confirmed before `older_than`; returns pages pruned."""
        heap, emptied = self._expiry, []
        while heap and heap[0][0] < older_than:
            _, _, node, holder = heapq.heappop(heap)
            holders = node.holders
            if not node.attached or holders is None or holder not in holders:
                continue  # stale: pruned or forgotten since
            seen = holders[holder]
            if seen >= older_than:  # confirmed again since: re-enter at its time
                self._seq += 1
                heapq.heappush(heap, (seen, self._seq, node, holder))
                continue
            self._drop_holder(node, holder)
            if not holders:
                emptied.append(node)
        return self._prune(emptied)

    def lru_leaf(self, tier: int = 0) -> TreeNode | None:
        """The least recently used tier leaf of `tier` (what `evict(n, tier)` takes next), left
        in place; None if there is none. Stale entries met on the way are dropped."""
        heap = self._heap(tier)
        while heap:
            seen, stamp, node = heap[0]
            if node.lru_stamp != stamp:
                heapq.heappop(heap)  # stale
            elif seen != node.last_access:  # used since it was queued: re-enter at its time
                self._seq += 1
                node.lru_stamp = self._seq
                heapq.heapreplace(heap, (node.last_access, self._seq, node))
            else:
                return node
        return None

    def set_tier(self, node: TreeNode, tier: int) -> None:
        """Record that `node`'s pages now live in `tier` (their values were repointed); the
        node and its parent change heaps as their tier-leaf status says."""
        if node.parent is None:
            raise InvalidRequest("the root has no tier")
        if node.tier == tier:
            return
        self._tiered = self._tiered or tier != 0
        self._unqueue_leaf(node)
        node.tier = tier
        self._requeue_if_leaf(node)
        parent = node.parent
        if self._is_tier_leaf(parent):
            if not parent.lru_stamp:
                self._queue_leaf(parent)
        else:
            self._unqueue_leaf(parent)

    def split(self, node: TreeNode, pages: int) -> TreeNode:
        """Cut `node` after its first `pages` pages (0 < pages < its length); returns the new
        upper node, `node` keeps the rest (and its place in the heaps)."""
        total = len(node.key) // self.page_bytes
        if node.parent is None or not node.attached or not 0 < pages < total:
            raise InvalidRequest(f"cannot split an edge of {total} pages after {pages}")
        return self._split(node, pages)

    def lru_unlocked(self) -> Iterator[TreeNode]:
        """Every unlocked node, least recently used first; a node only after all its children.

        This is the order `evict` would take them in (in a tree without tiers). It reads the
        eviction heap without changing it, so the first k nodes cost O(k log k) plus stale
        entries passed; do not change the tree while iterating.
        """
        heap = self._leaves
        # (time, stamp, slot, node): slot >= 0 is an index into `heap`, whose children in the
        # heap's implicit binary tree come no earlier; slot < 0 is an inner node whose
        # children have all been yielded, or a leaf re-keyed to its real last_access.
        # Slots are unique, so nodes are never compared.
        frontier: list[tuple[float, int, int, TreeNode | None]] = []
        if heap:
            frontier.append((heap[0][0], heap[0][1], 0, None))
        yielded_children: dict[int, int] = {}
        inner = 0
        while frontier:
            seen, stamp, slot, node = heapq.heappop(frontier)
            if node is None:
                for child_slot in (2 * slot + 1, 2 * slot + 2):
                    if child_slot < len(heap):
                        child_seen, child_stamp, _ = heap[child_slot]
                        heapq.heappush(frontier, (child_seen, child_stamp, child_slot, None))
                node = heap[slot][2]
                if node.lru_stamp != stamp:
                    continue  # stale entry
                if seen != node.last_access:  # used since queued: comes up at its real time
                    inner -= 1
                    heapq.heappush(frontier, (node.last_access, 0, inner, node))
                    continue
            yield node
            parent = self._parent(node)
            if parent is self.root:
                continue
            done = yielded_children.get(id(parent), 0) + 1
            yielded_children[id(parent)] = done
            if done == len(parent.children) and parent.lock_ref == 0:
                inner -= 1
                heapq.heappush(frontier, (parent.last_access, 0, inner, parent))

    def repoint(self, moved: Mapping[int, int], nodes: Iterable[TreeNode] | None = None) -> int:
        """Replace block addresses after their bytes moved (old -> new); returns how many.

        `nodes` limits the search to where the caller knows the addresses are (swap_out takes
        them from `lru_unlocked`); without it every node is searched.
        """
        count = 0
        for node in self._nodes() if nodes is None else nodes:
            value = node.value
            if value is None or moved.keys().isdisjoint(value):
                continue
            for i, addr in enumerate(value):
                fresh = moved.get(addr)
                if fresh is not None:
                    value[i] = fresh
                    count += 1
        return count

    def reset(self) -> array[int]:
        """Empty the tree (locked entries included); returns every value it held."""
        removed: array[int] = array("Q")
        for node in self._nodes():
            if node.value is not None:
                removed.extend(node.value)
            node.attached = False
            node.lru_stamp = 0
        self.root.children.clear()
        self.evictable_pages = self.protected_pages = 0
        self._leaves.clear()
        self._tier_leaves.clear()
        self._queued_leaves = 0
        self._expiry.clear()
        self._holder_entries = 0
        self._by_holder.clear()
        return removed

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before their children (tests and reporting)."""
        return self._nodes()

    def pretty(self) -> str:
        """Indented dump: pages, lock count, holders; for debugging and tests."""
        return tree_pretty(self)

    def sequences(self) -> Iterator[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf sequence of tokens with its values (tests and debugging)."""
        return tree_sequences(self)

    # ----------------------------------------------------------------- helpers

    def _page_key(self, tokens: Tokens) -> bytes:
        key = as_token_bytes(tokens)
        return key[: len(key) - len(key) % self.page_bytes]

    def _check_value(
        self, value: Sequence[int] | array[int] | None, pages: int
    ) -> array[int] | None:
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

    def _parent(self, node: TreeNode) -> TreeNode:
        """The parent of a node other than the root (which alone has none)."""
        parent = node.parent
        assert parent is not None, "the root has no parent"
        return parent

    def _descend(self, key: bytes, split: bool, now: float | None) -> tuple[TreeNode, int]:
        """Walk `key` down; returns the deepest fully matched node and the bytes matched.

        With `split`, a match ending inside an edge splits it so the returned node ends there.
        With `now`, every node walked whole counts as used now (a leaf's heap entry stays: it
        is re-keyed when it comes up).
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
        while node.parent is not None:
            depth += len(node.key)
            node = node.parent
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
        """Cut `child` after `pages` pages; returns the new upper node.

        The lower part keeps its place in the heaps (same node, same times); the upper part
        is an inner node, but holds what `child` held, so it joins the holder structures.
        """
        pb, cut = self.page_bytes, pages * self.page_bytes
        parent = self._parent(child)
        upper = TreeNode(
            child.key[:cut],
            None if child.value is None else child.value[: pages * self.stride],
            parent,
            {child.key[cut : cut + pb]: child},
            None if child.holders is None else dict(child.holders),
            child.lock_ref,
            child.last_access,
            tier=child.tier,
        )
        parent.children[child.key[:pb]] = upper
        child.key = child.key[cut:]
        if child.value is not None:
            child.value = child.value[pages * self.stride :]
        child.parent = upper
        if upper.holders:
            for holder, seen in upper.holders.items():
                self._index_holder(upper, holder, seen)
            self._holder_entries += len(upper.holders)
            self._compact_expiry_if_stale()
        return upper

    def _detach(self, node: TreeNode, removed: array[int]) -> int:
        """Remove `node` and its subtree, collecting values and fixing the page counts.

        Returns the pages removed. A parent left childless and unlocked becomes evictable.
        """
        parent = self._parent(node)
        pb = self.page_bytes
        del parent.children[node.key[:pb]]
        total = 0
        for sub in self._nodes(node) if node.children else (node,):  # evict: mostly a leaf
            pages = len(sub.key) // pb
            total += pages
            if sub.lock_ref:
                self.protected_pages -= pages
            else:
                self.evictable_pages -= pages
            if sub.value is not None:
                removed.extend(sub.value)
            sub.attached = False
            if sub.lru_stamp:  # (_unqueue_leaf, inlined: this runs per evicted node)
                sub.lru_stamp = 0
                self._queued_leaves -= 1
            if sub.holders:
                for holder in sub.holders:
                    self._unindex_holder(sub, holder)
                self._holder_entries -= len(sub.holders)
        self._requeue_if_leaf(parent)
        return total

    def _prune(self, emptied: list[TreeNode]) -> int:
        """Detach the nodes whose last holder just went, with their subtrees; returns pages.

        Between calls no attached node has an empty holder map, so these are exactly the
        nodes a whole-tree walk would find; detaching one inside another's subtree first
        leaves the same pages pruned.
        """
        pruned, dropped = 0, array("Q")
        for node in emptied:
            if node.attached:
                pruned += self._detach(node, dropped)
        return pruned

    # evictable leaves

    def _heap(self, tier: int) -> list[LeafEntry]:
        return self._leaves if tier == 0 else self._tier_leaves.setdefault(tier, [])

    def _queue_leaf(self, node: TreeNode) -> None:
        """(Re)enter an evictable leaf at its current last_access; an older entry goes stale."""
        self._seq += 1
        if not node.lru_stamp:
            self._queued_leaves += 1
        node.lru_stamp = self._seq
        heap = self._heap(node.tier)
        heapq.heappush(heap, (node.last_access, self._seq, node))
        if len(heap) > STALE_FACTOR * self._queued_leaves + STALE_FLOOR:
            heap[:] = [e for e in heap if e[2].lru_stamp == e[1]]
            heapq.heapify(heap)

    def _unqueue_leaf(self, node: TreeNode) -> None:
        if node.lru_stamp:
            node.lru_stamp = 0
            self._queued_leaves -= 1

    def _requeue_if_leaf(self, node: TreeNode) -> None:
        if self._is_tier_leaf(node):
            self._queue_leaf(node)

    def _is_tier_leaf(self, node: TreeNode) -> bool:
        """Unlocked, attached, not the root, and no child in its tier or a faster one."""
        if node.parent is None or not node.attached or node.lock_ref:
            return False
        if not self._tiered:
            return not node.children
        return all(child.tier > node.tier for child in node.children.values())

    def _pop_lru_leaf(self, tier: int = 0) -> TreeNode | None:
        """The least recently used evictable leaf, taken out of the heap; None if none.

        Every current entry's time is at most its node's last_access, so the first popped
        entry whose time is exact belongs to the least recently used leaf.
        """
        heap = self._heap(tier)
        while heap:
            seen, stamp, node = heapq.heappop(heap)
            if node.lru_stamp != stamp:
                continue  # stale
            if seen != node.last_access:  # used since it was queued: re-enter at its time
                self._seq += 1
                node.lru_stamp = self._seq
                heapq.heappush(heap, (node.last_access, self._seq, node))
                continue
            node.lru_stamp = 0
            self._queued_leaves -= 1
            return node
        return None

    # holders

    def _confirm(self, node: TreeNode, holder: Hashable, now: float) -> None:
        """`holder` holds `node` as of `now` (node.holders is a dict)."""
        holders = node.holders
        assert holders is not None
        if holder not in holders:
            self._holder_entries += 1
            self._index_holder(node, holder, now)
        holders[holder] = now  # its expiry entry, older, is re-keyed when it comes up

    def _index_holder(self, node: TreeNode, holder: Hashable, seen: float) -> None:
        self._by_holder.setdefault(holder, set()).add(node)
        self._seq += 1
        heapq.heappush(self._expiry, (seen, self._seq, node, holder))

    def _unindex_holder(self, node: TreeNode, holder: Hashable) -> None:
        held = self._by_holder.get(holder)
        if held is not None:
            held.discard(node)
            if not held:
                del self._by_holder[holder]

    def _drop_holder(self, node: TreeNode, holder: Hashable) -> None:
        """Forget one (node, holder) pair; its expiry entry goes stale."""
        assert node.holders is not None
        del node.holders[holder]
        self._unindex_holder(node, holder)
        self._holder_entries -= 1

    def _compact_expiry_if_stale(self) -> None:
        """Rebuild the expiry heap from its current entries once stale ones dominate."""
        if len(self._expiry) <= STALE_FACTOR * self._holder_entries + STALE_FLOOR:
            return
        current: dict[tuple[int, Hashable], ExpiryEntry] = {}
        for _, seq, node, holder in self._expiry:
            holders = node.holders
            if node.attached and holders is not None and holder in holders:
                current.setdefault((id(node), holder), (holders[holder], seq, node, holder))
        self._expiry = list(current.values())
        heapq.heapify(self._expiry)

    def _nodes(self, start: TreeNode | None = None) -> Iterator[TreeNode]:
        """Every node below and including `start` (default: all but the root), parents first."""
        stack = [start] if start is not None else list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
