"""Radix tree over token pages: MemPool's local index and the router's global prompt trees.

One tree type serves both uses (MemServe 4.2 and 6): a node's `value` holds the addresses of
its pages' KV blocks (the local index; an address names its tier and instance), and its
`holders` maps each instance known to hold the pages to when that was last confirmed (the
global trees, whose entries expire). Keys are whole pages of token ids (uint32); a partial
page never matches.

The tree is native code (`native/radix/`, the extension `mempool._radix`): every request
walks it, on the router and in the pool. It keeps incrementally what a whole-tree walk would
otherwise recompute, so eviction and expiry cost what they remove: the evictable leaves of each
tier in a lazy min-heap by last use, every (node, holder, last confirmed) in a lazy expiry heap,
and per holder the nodes it holds. Its behaviour is the Python tree's it replaced, which the
tests keep as the reference model (tests/mempool/radix_model.py) and drive side by side.

Tiers (MemPool with a device and a host tier): a node's `tier` says where its pages live,
lower numbers faster. A node is a *tier leaf* when it is unlocked and no child sits in the same
or a faster tier; `lru_leaf(device)` is the next device run to swap out, `evict(n, host)` drops
the least recently used host leaves.

Node handles (`TreeNode`) name a node of one tree: using one after its node left the tree
(evicted, deleted, pruned, reset), or with another tree, raises InvalidRequest. A node
detached while locked stays valid until its last unlock. Bad input (token ids outside uint32,
no tokens, address lists of the wrong length or type) raises mempool.errors' exceptions.

Public API: `match`, `holders`, `insert`, `delete`, `evict`, `lock`/`unlock`, `remove_holder`,
`expire`, `lru_leaf`, `set_tier`, `split`, `lru_unlocked` and `repoint` (swapping between
tiers), `reset`, `nodes`, `pretty`, `sequences`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

from mempool._radix import TOKEN_BYTES, InsertResult, Match, TreeNode
from mempool._radix import RadixTree as _NativeTree
from mempool.errors import InvalidRequest, InvalidTokens

__all__ = [
    "TOKEN_BYTES",
    "InsertResult",
    "Match",
    "RadixTree",
    "Tokens",
    "TreeNode",
    "as_token_bytes",
    "token_array",
]

Tokens: TypeAlias = "Sequence[int] | array[int]"


def token_array(tokens: Tokens) -> array[int]:
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


class RadixTree(_NativeTree):
    """Page radix tree (native). `slots_per_page` addresses are stored per page (0: a
    holders-only tree); `clock` must never go backwards, time.monotonic by default.

    Adds the debugging views, which need no speed, in Python.
    """

    def pretty(self) -> str:
        """Indented dump: pages, lock count, holders; for debugging and tests."""
        return tree_pretty(self)

    def sequences(self) -> Iterator[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf sequence of tokens with its values (tests and debugging)."""
        return tree_sequences(self)


def tree_pretty(tree: Any) -> str:
    """A tree's indented dump (pages, lock count, holders), from its public node views: any
    tree with this node shape, the native one or the tests' reference trees."""
    lines: list[str] = []

    def visit(node: Any, depth: int) -> None:
        for child in node.children.values():
            pages = len(child.key) // tree.page_bytes
            holders = sorted(map(str, child.holders)) if child.holders else []
            lines.append(f"{'  ' * depth}[{pages}p lock={child.lock_ref}] {holders}")
            visit(child, depth + 1)

    visit(tree.root, 0)
    return "\n".join(lines)


def tree_sequences(tree: Any) -> Iterator[tuple[tuple[int, ...], list[int]]]:
    """Every root-to-leaf sequence of a tree's tokens with its values."""

    def visit(
        node: Any, tokens: tuple[int, ...], vals: list[int], root: bool
    ) -> Iterator[tuple[tuple[int, ...], list[int]]]:
        children = node.children
        if not children and not root:
            yield tokens, vals
        for child in children.values():
            value = child.value
            yield from visit(
                child,
                tokens + tuple(array("I", child.key)),
                vals + (list(value) if value is not None else []),
                False,
            )

    yield from visit(tree.root, (), [], True)
