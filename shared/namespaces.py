"""Cache namespaces: which requests may share cached KV, as SGLang keys its radix cache.

SGLang keys a request's prefix by `(extra_key or "") + lora_id` (the namespace: children of
the radix root are split by it, so different adapters or extra keys never share a page) and,
apart from it, by `cache_salt` (PR #10718, kept apart from `extra_key` by PR #30827). This
worker does the same on MemPool's index, which keys pages by token ids alone: a request with
a namespace has the first whole page of its namespaced part replaced, in the index key only,
by `page_size` ids derived from SHA-256 (SHAKE-256) of the namespace and the page's tokens,
each with the top bit set, which no vocabulary id has. Every later page hangs under that one,
so nothing in another namespace, or in none, can ever match it; the KV written into the
blocks is the real tokens', and the response's `cached_tokens` counts only the namespace's
own hits.

Public prefixes (our extension, named after vLLM PR #37961's `shared_prefix_tokens`, which
was not merged): a request may say that its first `shared_prefix_tokens` tokens are shared
by everyone with the same `extra_key` and adapter; those tokens, rounded down to whole
pages, are keyed without the salt, and the salt starts at the next page. A shared tool list
or system prompt is then cached once for every tenant, and what follows it in each tenant's
namespace.

The derived key page carries `31 x page_size` bits, so namespaces need `--page-size` >= 8
(248 bits: no collision between two namespaces' pages can be found); on a smaller page a
namespaced request is refused with a 400 rather than risk sharing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Any, NamedTuple

# Smallest page on which a derived key page is collision-free (8 x 31 bits).
MIN_NAMESPACE_PAGE = 8
_TOP = 0x80000000


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Where a request's KV may be shared: `extra_key` plus the adapter's `lora_id`
    (SGLang's namespace), `cache_salt` after the first `shared_prefix_tokens` tokens."""

    extra_key: str = ""
    lora_id: str = ""  # the loaded adapter's id (a new one each time it is loaded)
    lora_name: str | None = None  # reported in KV events; not part of the key
    cache_salt: str | None = None
    shared_prefix_tokens: int = 0
    # A router serving several models keys every model but its default one apart (its trees
    # hold every model's paths; no prefix may match across models). Workers never set it.
    model: str = ""

    @classmethod
    def named(
        cls,
        extra_key: str,
        adapter: str | None,
        cache_salt: str | None,
        shared: int,
        model: str = "",
    ) -> CacheNamespace:
        """A namespace keyed by its adapter's name, as a router keys it (it does not know a
        worker's per-load adapter ids; its trees only need to tell namespaces apart)."""
        return cls(extra_key, adapter or "", adapter or None, cache_salt, shared, model)

    @property
    def keyed(self) -> bool:
        """Whether the namespace part (extra_key + adapter, a router's model) is set at all."""
        return bool(self.extra_key or self.lora_id or self.model)

    def salt_page(self, page: int) -> int | None:
        """Index of the first salted page (the public prefix rounded down to pages)."""
        if self.cache_salt is None:
            return None
        return self.shared_prefix_tokens // page

    def _tags(self, page: int) -> dict[int, bytes]:
        """Page index -> what its derived key is seeded with."""
        tags: dict[int, list[bytes]] = {}
        if self.keyed:
            tag = _field(b"ns", self.extra_key) + _field(b"lora", self.lora_id)
            tags.setdefault(0, []).append(tag + _field(b"model", self.model) if self.model else tag)
        salt = self.salt_page(page)
        if salt is not None:
            tags.setdefault(salt, []).append(_field(b"salt", self.cache_salt or ""))
        return {i: b"".join(parts) for i, parts in tags.items()}

    def key(self, tokens: Tokens[int], page: int) -> list[int]:
        """The index key of `tokens` (a copy with the derived pages in place). Prefix-stable:
        the key of a prefix is the prefix of the key, whole page by whole page."""
        out = list(tokens)
        for start, ids in self.derived(tokens, page):
            out[start : start + page] = ids
        return out

    def derived(self, tokens: Tokens[int], page: int) -> Iterator[tuple[int, list[int]]]:
        """(start, ids) of each page of `tokens` its key replaces (a partial page is never
        indexed, so never replaced)."""
        for index, tag in self._tags(page).items():
            start = index * page
            if start + page <= len(tokens):
                yield start, derived_page(tag, tokens[start : start + page])

    def event_metadata(self, page_index: int, page: int) -> dict[str, Any]:
        """What KV events say about the namespace of page `page_index`."""
        salt = self.salt_page(page)
        meta: dict[str, Any] = {}
        if salt is not None and page_index >= salt:
            meta["cache_salt"] = self.cache_salt
        if self.extra_key:
            meta["extra_key"] = self.extra_key
        if self.lora_name is not None:
            meta["lora_name"] = self.lora_name
        return meta


class NamespaceFields(NamedTuple):
    """A request's cache namespace as it names it (SGLang's fields, and ours)."""

    extra_key: str  # "" without one
    cache_salt: str | None
    shared_prefix_tokens: int
    adapter: str | None  # the LoRA adapter's name: `model="base:adapter"`, else `lora_path`

    @property
    def any(self) -> bool:
        return bool(self.extra_key or self.cache_salt is not None or self.adapter)


def namespace_fields(body: Mapping[str, Any]) -> NamespaceFields:
    """The cache namespace fields of a request body, checked (a ValueError says which field
    and why). The worker and the router read them alike: what the router predicts a worker
    holds is keyed as the worker keys it."""
    adapter = model_adapter(body.get("model"))
    return NamespaceFields(
        _opt_str("extra_key", body.get("extra_key")) or "",
        _opt_str("cache_salt", body.get("cache_salt")),
        _count("shared_prefix_tokens", body.get("shared_prefix_tokens")),
        adapter or _opt_str("lora_path", body.get("lora_path")) or None,
    )


def model_adapter(model: Any) -> str | None:
    """The adapter of an OpenAI `model` in SGLang's `base:adapter` form (None: none); it
    wins over `lora_path`, as in SGLang."""
    if model is None:
        return None
    if not isinstance(model, str):
        raise ValueError(f"'model' must be a string, got {type(model).__name__} {model!r:.60}")
    if ":" not in model:
        return None
    adapter = model.split(":", 1)[1]
    if not adapter:
        raise ValueError(f"'model' {model!r}: no adapter name after ':'")
    return adapter


def _opt_str(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        raise ValueError(f"'{name}' as a list (a batch of prompts) is not supported; give one")
    raise ValueError(f"'{name}' must be a string, got {type(value).__name__} {value!r:.60}")


def _count(name: str, value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{name}' must be an integer, got {type(value).__name__} {value!r:.60}")
    if value < 0:
        raise ValueError(f"'{name}' must be >= 0, got {value}")
    return value


def _field(name: bytes, value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return name + b"\0" + len(data).to_bytes(8, "big") + data


def derived_page(tag: bytes, tokens: Tokens[int]) -> list[int]:
    """`len(tokens)` ids (top bit set) from SHAKE-256 over the tag and the page's tokens."""
    n = len(tokens)
    h = hashlib.shake_256(b"memserve-cache-namespace\0" + tag)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    raw = h.digest(4 * n)
    return [int.from_bytes(raw[4 * i : 4 * i + 4], "little") | _TOP for i in range(n)]


def key_tokens(tokens: Tokens[int], ns: CacheNamespace | None, page: int) -> Tokens[int]:
    """`tokens` as the index keys them for a request in namespace `ns`."""
    return tokens if ns is None else ns.key(tokens, page)
