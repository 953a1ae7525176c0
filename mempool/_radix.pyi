"""Types of the native page radix tree (native/radix/bind.cpp); mempool.radix documents it."""

from array import array
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

TOKEN_BYTES: int

_Tokens = Sequence[int] | array[int]
_Addresses = Sequence[int] | array[int]

class TreeNode:
    """A handle on one node of one tree; raises InvalidRequest once the node left the tree."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> array[int] | None: ...
    @value.setter
    def value(self, value: _Addresses) -> None: ...
    @property
    def parent(self) -> TreeNode | None: ...
    @property
    def children(self) -> dict[bytes, TreeNode]: ...
    @property
    def holders(self) -> dict[Hashable, float] | None: ...
    @property
    def lock_ref(self) -> int: ...
    @property
    def last_access(self) -> float: ...
    @property
    def attached(self) -> bool: ...
    @property
    def tier(self) -> int: ...
    @property
    def lru_stamp(self) -> int: ...
    @property
    def valid(self) -> bool: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Match:
    num_tokens: int
    value: array[int]
    node: TreeNode
    holder_tokens: dict[Hashable, int]
    def __init__(
        self,
        num_tokens: int,
        value: array[int],
        node: TreeNode,
        holder_tokens: dict[Hashable, int],
    ) -> None: ...

class InsertResult:
    existing_tokens: int
    new_tokens: int
    duplicates: list[int]
    node: TreeNode
    def __init__(
        self, existing_tokens: int, new_tokens: int, duplicates: list[int], node: TreeNode
    ) -> None: ...

class RadixTree:
    def __init__(
        self,
        page_size: int = 16,
        slots_per_page: int = 1,
        clock: Callable[[], float] | None = None,
    ) -> None: ...
    @property
    def page_size(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def root(self) -> TreeNode: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def protected_pages(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    def match(self, tokens: _Tokens, ttl: float | None = None, split: bool = False) -> Match:
        """Longest cached page-aligned prefix of `tokens`.

        With `split`, a match ending inside an edge splits it so that `node` ends exactly at
        the match (needed to `lock` it); without, the tree is left as it is and `node` is the
        deepest node the match covers whole. With `ttl`, holders not confirmed within the
        last `ttl` seconds are ignored.
        """
    def holders(self, tokens: _Tokens, ttl: float | None = None) -> dict[Hashable, int]:
        """`match(tokens, ttl).holder_tokens` in one walk down: the router's per-request
        lookup, which needs neither the values nor the deepest node."""
    def insert(
        self,
        tokens: _Tokens,
        value: _Addresses | None = None,
        holder: Hashable | None = None,
        tier: int = 0,
    ) -> InsertResult:
        """Add the whole pages of `tokens`; existing pages keep their value.

        `value` must hold slots_per_page addresses per whole page. Addresses given for pages
        that were cached already and differ from the cached ones come back as `duplicates`.
        With `holder`, every node on the path records it as holding the pages now. New pages
        go into one new leaf in `tier`.
        """
    def delete(self, tokens: _Tokens) -> array[int]:
        """Drop the cached pages of `tokens` that no other cached sequence shares; returns
        their values, deepest first. Raises BlockInUse (removing nothing) if one is locked."""
    def evict(self, num_pages: int, tier: int = 0) -> tuple[int, array[int]]:
        """Remove least-recently-used unlocked tier leaves of `tier` until `num_pages`
        pages are gone; returns (pages removed, their values). A parent left childless
        becomes evictable in turn."""
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction and deletion (a running request)."""
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock`; InvalidRequest if the node is not locked."""
    def remove_holder(
        self, holder: Hashable, tokens: _Tokens | None = None, keep_tokens: int = 0
    ) -> int:
        """Forget that `holder` holds pages; returns the pages pruned from the tree.

        Without `tokens`: everywhere (a removed or dead instance). With `tokens`: on that
        prompt's path beyond its first `keep_tokens` tokens and below. Nodes left with no
        holder are pruned, with their subtrees.
        """
    def expire(self, older_than: float) -> int:
        """Drop holder entries last confirmed before `older_than`; returns pages pruned."""
    def lru_leaf(self, tier: int = 0) -> TreeNode | None:
        """The least recently used tier leaf of `tier` (what `evict(n, tier)` takes next),
        left in place; None if there is none."""
    def set_tier(self, node: TreeNode, tier: int) -> None:
        """Record that `node`'s pages now live in `tier` (their values were repointed)."""
    def split(self, node: TreeNode, pages: int) -> TreeNode:
        """Cut `node` after its first `pages` pages (0 < pages < its length); returns the
        new upper node, `node` keeps the rest (and its place in the heaps)."""
    def lru_unlocked(self, limit: int | None = None) -> list[TreeNode]:
        """Unlocked nodes, least recently used first, a node only after all its children
        (the order `evict` takes them in a tree without tiers); at most `limit` of them."""
    def repoint(self, moved: Mapping[int, int], nodes: Iterable[TreeNode] | None = None) -> int:
        """Replace block addresses after their bytes moved (old -> new); returns how many.
        `nodes` limits the search to where the caller knows the addresses are."""
    def reset(self) -> array[int]:
        """Empty the tree (locked entries included); returns every value it held."""
    def nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before their children."""
    # white-box views for the tests and benchmarks
    def _check(self) -> None: ...
    def _heap_size(self, tier: int = 0) -> int: ...
    @property
    def _expiry_size(self) -> int: ...
    @property
    def _queued_leaves(self) -> int: ...
    @property
    def _holder_entries(self) -> int: ...
    @property
    def _full_walks(self) -> int: ...
    @property
    def _live_nodes(self) -> int: ...
    @property
    def _known_holders(self) -> int: ...
    @property
    def _memory_bytes(self) -> int: ...

# The router's decision (native/radix/decide.cpp; router.policies documents the rules).

class WorkerState:
    """One worker's figures as the decision reads them: the router's counters, the worker's
    reports, its learned speed (router.workers.Worker keeps one)."""

    def __init__(self, url: str | None = None, prefill: bool = False) -> None: ...
    @property
    def url(self) -> str | None: ...
    @property
    def prefill(self) -> bool: ...
    in_flight: int
    in_flight_tokens: int
    peer_in_flight: int
    peer_in_flight_tokens: int
    reported_reqs: int
    reported_waiting: int
    reported_pending_tokens: int
    report_asks: int  # reports asked of it (a request records the count when sent)
    reported_ended: int  # of ours in flight at the last ask, those answered since
    unstarted: int
    pulls_served: int
    has_agent: bool
    can_pull: bool
    free_tokens: int  # device KV free, from its KV events (-1: not known)
    in_flight_fixed_s: float  # loads this router's requests not begun wait for (adapters)
    overhead_s: float
    queue_x: float
    token_x: float
    pair_x: float
    transfer_x: float  # x the constants' transfer time of a pull into it
    drawn: float  # prompt tokens the prompt_tree rule sent it to compute, decayed since drawn_at
    drawn_at: float  # on the traffic clock (the heat's)
    @property
    def load(self) -> int: ...
    @property
    def queued_tokens(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def finished(self) -> int:
        """Requests counted for the service rate (the last 32 at most)."""
    def finish(self, at: float | None = None) -> None:
        """A request ended at `at` (time.monotonic; None: now)."""
    def service_rate(self, now: float | None = None) -> float | None: ...
    def measured_wait_s(self, now: float | None = None) -> float: ...

class Heat:
    """Decayed counts of requests per prefix (its length and last page)."""

    def __init__(
        self,
        page_size: int = 16,
        half_life_s: float = 30.0,
        max_entries: int = 16384,
        clock: Callable[[], float] | None = None,
    ) -> None: ...
    def bump(self, tokens: _Tokens, length: int) -> float:
        """Requests that reused the first `length` tokens before this one (decayed); this one
        is counted, among all requests as well. 0 for a prefix under a page."""
    def share(self, heat: float) -> float: ...
    @property
    def before(self) -> float: ...
    @property
    def page_size(self) -> int: ...
    def __len__(self) -> int: ...

# the work terms: queue, own tokens, their attention pairs, a pull's transfer, the modelled rest
_Work = tuple[float, float, float, float, float]
_Choice = tuple[int, str, int, list[tuple[int, int]], int | None, _Work]

class Decider:
    """The prompt_tree or cost rule with the cost model's constants."""

    def __init__(
        self,
        rule: str,
        page_size: int,
        pulls: bool,
        balance_abs: int,
        balance_rel: float,
        prefill_s_per_token: float,
        transfer_s_per_token: float,
        busy_s_per_request: float,
        host_load_s_per_token: float,
        prefill_s_per_token_pair: float,
        heat: Heat | None = None,
    ) -> None: ...
    heat: Heat | None
    @property
    def page_size(self) -> int: ...
    def decide(
        self,
        tree: RadixTree,
        tokens: _Tokens,
        num_tokens: int,
        workers: Sequence[WorkerState],
        ttl: float | None = None,
        before: Sequence[float] | None = None,
        pull_limit: int = -1,
        stall: Sequence[float] | None = None,
    ) -> _Choice:
        """(worker index, reason, predicted cached tokens, longer holders as (index, tokens)
        longest first, index pulled from or None, work terms at the constants). `before`:
        seconds each worker spends on the request before its prefill (an adapter to load, or
        a slot to wait for), finite and not negative, one per worker. `pull_limit`: the most
        of the prefix a pull may cover (-1: all; 0: no pull, and no holders named), else
        ValueError. `stall`: of `before`, the seconds each worker's engine spends on it in
        the step that prefills it (an adapter's load), which the requests waiting there wait
        too; checked as `before`."""
    def decide_view(
        self,
        view: Sequence[tuple[int, int, int]],
        tokens: _Tokens,
        num_tokens: int,
        workers: Sequence[WorkerState],
        before: Sequence[float] | None = None,
        pull_limit: int = -1,
        stall: Sequence[float] | None = None,
    ) -> _Choice:
        """`decide` over a view given per worker as (any tier, device, home), -1 for none."""
    def plan(
        self,
        worker: WorkerState,
        num_tokens: int,
        cached: int,
        host: int = 0,
        source: WorkerState | None = None,
        best: int = 0,
        load: int | None = None,
    ) -> tuple[float, int, bool, _Work]: ...
    def queue_s(self, worker: WorkerState, host: int = 0, load: int | None = None) -> float: ...
