"""The tenants file: its tenants (hashed keys, settings) and public prefixes, parsed and
checked (router.tenants)."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

_KEY = re.compile(r"sha256:([0-9a-f]{64})")
_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = {
    "id",
    "keys",
    "own_salt",
    "max_in_flight",
    "tokens_per_s",
    "max_tree_pages",
    "share",
}
_TOP_FIELDS = {"tenants", "public_prefixes", "tree_pages_per_tenant"}


class TenantsError(ValueError):
    """A tenants file that cannot be used: what is wrong, and where."""


def hash_key(key: str) -> str:
    """The form a key is stored in: `sha256:<hex of its UTF-8>`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    own_salt: bool = False  # may its clients choose a salt (under the tenant's)?
    max_in_flight: int = 0  # requests in flight at once, this router (0: unlimited)
    tokens_per_s: float = 0.0  # prompt + most output tokens a second, this router (0: none)
    key_hashes: tuple[bytes, ...] = ()
    # pages of each prompt tree its namespaces may hold (None: the file's default)
    max_tree_pages: int | None = None
    share: float = 1.0  # its weight in fair admission by computed tokens (router.tenants.fair)


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    """A prefix every tenant may share: its text when the file gives it, its SHA-256, and
    its length in characters (for a text prompt's start; None: a chat's system message
    only)."""

    sha256: str
    text: str | None = None
    chars: int | None = None


@dataclass(slots=True)
class TenantsFile:
    tenants: dict[str, Tenant]
    by_key: dict[bytes, Tenant]
    public: list[PublicPrefix] = field(default_factory=list)
    # a tenant's tree pages when it gives no max_tree_pages (0: --max-tree-size split evenly)
    tree_pages_per_tenant: int = 0


def parse(text: str, name: str = "tenants file") -> TenantsFile:
    """A tenants file's text (JSON, or TOML when it does not start with '{'); TenantsError
    naming what is wrong."""
    stripped = text.lstrip()
    try:
        data: Any = json.loads(text) if stripped.startswith("{") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise TenantsError(f"{name}: not valid JSON or TOML: {exc}") from None
    if not isinstance(data, dict):
        raise TenantsError(f"{name}: must be an object (JSON) or a table (TOML)")
    unknown = set(data) - _TOP_FIELDS
    if unknown:
        raise TenantsError(f"{name}: unknown top-level keys {sorted(unknown)}")
    entries = data.get("tenants")
    if isinstance(entries, dict):  # {id: settings} / [tenants.<id>] tables
        entries = [{**v, "id": k} if isinstance(v, dict) else v for k, v in entries.items()]
    if not isinstance(entries, list) or not entries:
        raise TenantsError(f"{name}: 'tenants' must be a non-empty list (or table) of tenants")
    tenants: dict[str, Tenant] = {}
    by_key: dict[bytes, Tenant] = {}
    for i, entry in enumerate(entries):
        tenant = _tenant(entry, f"{name}: tenants[{i}]")
        if tenant.id in tenants:
            raise TenantsError(f"{name}: tenant {tenant.id!r} is given twice")
        tenants[tenant.id] = tenant
        for digest in tenant.key_hashes:
            if digest in by_key:
                other = by_key[digest].id
                raise TenantsError(f"{name}: tenants {other!r} and {tenant.id!r} share a key")
            by_key[digest] = tenant
    public = data.get("public_prefixes", [])
    if not isinstance(public, list):
        raise TenantsError(f"{name}: 'public_prefixes' must be a list")
    prefixes = [_public(p, f"{name}: public_prefixes[{i}]") for i, p in enumerate(public)]
    default_pages = _pages(data.get("tree_pages_per_tenant", 0), f"{name}: 'tree_pages_per_tenant'")
    return TenantsFile(tenants, by_key, prefixes, default_pages or 0)


def _pages(value: Any, where: str, least: int = 0) -> int | None:
    """A number of tree pages: a whole number >= `least` (None stays None: not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TenantsError(
            f"{where} must be a whole number of tree pages >= {least}, got {value!r:.40}"
        )
    return value


def _tenant(entry: Any, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise TenantsError(f"{where} must be an object")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise TenantsError(f"{where}: unknown keys {sorted(unknown)}")
    tid = entry.get("id")
    if not isinstance(tid, str) or not tid or len(tid) > 128 or not tid.isprintable():
        raise TenantsError(f"{where}: 'id' must be a non-empty printable string")
    where = f"{where} ({tid!r})"
    keys = entry.get("keys")
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not keys:
        raise TenantsError(f"{where}: 'keys' must be a non-empty list of 'sha256:<hex>'")
    hashes = []
    for key in keys:
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise TenantsError(
                f"{where}: keys are stored hashed, as 'sha256:' and 64 lowercase hex digits "
                "(python -m router.tenants hash-key); got something else"  # never echo a key
            )
        hashes.append(bytes.fromhex(match.group(1)))
    own = entry.get("own_salt", False)
    if not isinstance(own, bool):
        raise TenantsError(f"{where}: 'own_salt' must be true or false")
    limit = entry.get("max_in_flight", 0)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TenantsError(f"{where}: 'max_in_flight' must be a whole number >= 0 (0: no limit)")
    rate = entry.get("tokens_per_s", 0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1e18:
        raise TenantsError(f"{where}: 'tokens_per_s' must be a number >= 0 (0: no limit)")
    pages = _pages(entry.get("max_tree_pages"), f"{where}: 'max_tree_pages'", 1)
    share = entry.get("share", 1.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1e9:
        raise TenantsError(
            f"{where}: 'share' must be a number > 0 (a relative weight), got {share!r:.40}"
        )
    return Tenant(tid, own, limit, float(rate), tuple(hashes), pages, float(share))


def _public(entry: Any, where: str) -> PublicPrefix:
    if isinstance(entry, str):
        entry = {"text": entry}
    if not isinstance(entry, dict) or set(entry) - {"text", "sha256", "chars"}:
        raise TenantsError(f"{where}: a text, or an object with 'text' or 'sha256' (+ 'chars')")
    text = entry.get("text")
    if text is not None:
        if not isinstance(text, str) or not text or len(entry) > 1:
            raise TenantsError(f"{where}: 'text' must be a non-empty string, alone")
        return PublicPrefix(sha(text), text, len(text))
    digest, chars = entry.get("sha256"), entry.get("chars")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest.removeprefix("sha256:")):
        raise TenantsError(f"{where}: 'sha256' must be 64 lowercase hex digits")
    if chars is not None and (isinstance(chars, bool) or not isinstance(chars, int) or chars < 1):
        raise TenantsError(f"{where}: 'chars' must be a whole number >= 1")
    return PublicPrefix(digest.removeprefix("sha256:"), None, chars)


def sha(text: str) -> str:
    """A text's SHA-256, hex (how public prefixes are named by hash)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
