"""A group's share of a prefix tree: its requests' paths hold at most so many pages, and over
that the group loses its own least recently recorded paths, never another group's.

The router bounds each tenant's pages of its prompt trees with it (router.trees), and a
worker each salt group's pages of its KV cache (connector.worker.kv_cache,
`--max-cached-tokens-per-salt`). The attack this bounds: a tenant allowed its own salt sends
a fresh random `cache_salt` on every request. Each request is a new namespace
(`<tenant salt>:<client salt>`), a path that can never be hit again, and a size bound that
evicts least-recently-used leaves whoever holds them would push every other tenant's paths
out: the router's routing state, the workers' cached KV.

So per tree and group this keeps the paths its requests recorded, in the order last
recorded, with the pages each record added (the tree's page count before and after the
insert: exact, and only paid for a group's request). Over the group's share it removes the
group's oldest paths (a tree's delete removes the path's leaf and the ancestors no other path
uses). A path that later paths extend (the first turns of a conversation) is not a leaf: its
pages are kept, and their count with them, until the path that extends it goes too. Pages
that leave the tree by expiry or eviction are counted until their path comes up.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mempool.radix import as_token_bytes


class Paths(Protocol):
    """The tree a share is kept in, as the share removes from it."""

    def remove(self, tokens: array[int]) -> int:
        """Delete the path's pages no other path uses; the pages freed (0: none could go)."""

    def holds(self, tokens: array[int]) -> bool:
        """Whether every page of the path is still in the tree."""


@dataclass(slots=True)
class _Holding:
    """One group's paths in one tree: key bytes -> pages it added, oldest first."""

    paths: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    pages: int = 0  # pages its paths added, that are still counted
    kept: int = 0  # of which, pages of deleted paths that later paths extend (not freed)


class PathShares:
    """The pages each group's requests recorded in each tree, bounded by `limit(group)`
    (0: unbounded, nothing kept)."""

    def __init__(self, page_size: int, limit: Callable[[str], int]) -> None:
        self.page_size = page_size
        self.limit = limit
        self._held: dict[tuple[object, str], _Holding] = {}
        self.deleted_pages = 0  # pages freed from groups over their share

    def pages(self, tree: object, group: str) -> int:
        """Pages `group`'s requests are counted as holding in `tree` (a tree's name)."""
        held = self._held.get((tree, group))
        return held.pages if held is not None else 0

    def by_group(self) -> dict[str, int]:
        """Pages counted per group, over every tree."""
        out: dict[str, int] = {}
        for (_, group), held in self._held.items():
            out[group] = out.get(group, 0) + held.pages
        return out

    def charge(
        self, name: object, group: str, tokens: Sequence[int], added: int, paths: Paths
    ) -> None:
        """`group`'s request recorded `tokens` in the tree `name` (`paths`), which added
        `added` pages; over its share, its oldest paths go."""
        limit = self.limit(group)
        if not limit:
            return
        held = self._held.setdefault((name, group), _Holding())
        whole = len(tokens) - len(tokens) % self.page_size
        key = as_token_bytes(tokens[:whole])
        held.paths[key] = held.paths.pop(key, 0) + added  # the newest
        held.pages += added
        while held.pages > limit and len(held.paths) > 1:
            self._delete_oldest(paths, held)

    def _delete_oldest(self, paths: Paths, held: _Holding) -> None:
        key, charged = held.paths.popitem(last=False)
        tokens = array("I")
        tokens.frombytes(key)
        freed = paths.remove(tokens)
        self.deleted_pages += freed
        if freed == 0 and paths.holds(tokens):
            held.kept += charged  # extended by a later path (or in use): counted until it goes
            return
        if freed > charged:  # it took pages of earlier paths it extended with it
            released = min(freed - charged, held.kept)
            held.kept -= released
            charged += released
        held.pages = max(held.pages - charged, 0)

    def clear(self) -> None:
        """Stop counting what the trees no longer hold (they were cleared)."""
        self._held.clear()
