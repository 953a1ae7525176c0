"""A tenant's share of the router's prompt trees: its namespaces hold at most so many pages,
and over that it loses its own least recently recorded paths, never another tenant's.

The attack this bounds: a tenant allowed its own salt sends a fresh random `cache_salt` on
every request. Each request is a new namespace (`<tenant salt>:<client salt>`), a new path
that can never be hit again, and the trees' size bound evicts least-recently-used leaves
whoever holds them: the flood would push every other tenant's routing state out, and their
requests would go where their prefixes are not.

So per tree and tenant the router keeps the paths its requests recorded, in the order last
recorded, with the pages each record added (the tree's page count before and after the
insert: exact, and only paid for a tenant's request). Over the tenant's share it deletes its
oldest paths (`RadixTree.delete` removes the path's leaf and the ancestors no other path
uses). A path that later paths extend (the first turns of a conversation) is not a leaf:
its pages are kept, and their count with them, until the path that extends it goes too.
Pages that leave the trees by expiry or eviction are counted until their path comes up.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mempool.radix import RadixTree, as_token_bytes


@dataclass(slots=True)
class _Holding:
    """One tenant's paths in one tree: key bytes -> pages it added, oldest first."""

    paths: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    pages: int = 0  # pages its paths added, that are still counted
    kept: int = 0  # of which, pages of deleted paths that later paths extend (not freed)


class TreeShares:
    """The pages each tenant's requests recorded in each tree, bounded by `limit(tenant)`
    (0: unbounded, nothing kept)."""

    def __init__(self, page_size: int, limit: Callable[[str], int]) -> None:
        self.page_size = page_size
        self.limit = limit
        self._held: dict[tuple[object, str], _Holding] = {}
        self.deleted_pages = 0  # pages freed from tenants over their share

    def pages(self, tree: object, tenant: str) -> int:
        """Pages `tenant`'s requests are counted as holding in `tree` (a tree's key)."""
        held = self._held.get((tree, tenant))
        return held.pages if held is not None else 0

    def by_tenant(self) -> dict[str, int]:
        """Pages counted per tenant, over every tree (/get_server_info)."""
        out: dict[str, int] = {}
        for (_, tenant), held in self._held.items():
            out[tenant] = out.get(tenant, 0) + held.pages
        return out

    def insert(
        self, name: object, tree: RadixTree, tenant: str, tokens: Sequence[int], holder: object
    ) -> None:
        """`tree.insert(tokens, holder)` for `tenant`'s request; over its share, its oldest
        paths go. `name` names the tree (its worker type)."""
        limit = self.limit(tenant)
        if not limit:
            tree.insert(tokens, holder=holder)
            return
        before = tree.num_pages
        tree.insert(tokens, holder=holder)
        added = tree.num_pages - before
        held = self._held.setdefault((name, tenant), _Holding())
        whole = len(tokens) - len(tokens) % self.page_size
        key = as_token_bytes(tokens[:whole])
        held.paths[key] = held.paths.pop(key, 0) + added  # the newest
        held.pages += added
        while held.pages > limit and len(held.paths) > 1:
            self._delete_oldest(tree, held)

    def _delete_oldest(self, tree: RadixTree, held: _Holding) -> None:
        key, charged = held.paths.popitem(last=False)
        tokens = array("I")
        tokens.frombytes(key)
        before = tree.num_pages
        tree.delete(tokens)
        freed = before - tree.num_pages
        self.deleted_pages += freed
        if freed == 0 and _whole_path_held(tree, tokens):
            held.kept += charged  # extended by a later path: counted until that one goes
            return
        if freed > charged:  # it took pages of earlier paths it extended with it
            released = min(freed - charged, held.kept)
            held.kept -= released
            charged += released
        held.pages = max(held.pages - charged, 0)

    def clear(self) -> None:
        """Stop counting what the trees no longer hold (they were cleared)."""
        self._held.clear()


def _whole_path_held(tree: RadixTree, tokens: array[int]) -> bool:
    """Whether every page of `tokens` is still in the tree (by any holder, expired or not)."""
    found = tree.holders(tokens)
    return bool(found) and max(found.values()) >= len(tokens)
