"""Tenants: API keys per tenant, the cache namespace the router mints for each, public
prefixes, and per-tenant limits (issue 38).

An engine's `cache_salt` is an isolation key, not authentication: whoever sends a victim's
salt shares the victim's cache (vLLM's CVE-2025-46570). So with `--tenants FILE` the router
decides it. Each tenant has one or more API keys, stored as `sha256:<hex>` of the key
(`python -m router.tenants hash-key`); a request's key names its tenant, and on every
inference route the router sets the body's `cache_salt` to HMAC-SHA256(secret, tenant id)
(the secret from `--tenant-secret` or `$MEMSERVE_ROUTER_TENANT_SECRET`, which every replica
and process of the router must share, else a random one). A client's `cache_salt` is
replaced, unless the tenant has `own_salt`, in which case it goes after the tenant's salt
(`<tenant salt>:<client salt>`: two tenants still never meet); a client's `extra_key` is
kept under the tenant's (`<tenant salt>:<extra_key>`); a client's `shared_prefix_tokens` is
dropped (only the router says what is public).

Public prefixes: texts an operator lists (or the SHA-256 of them) that every tenant may
share, e.g. a tool list or a system prompt. A chat whose first message is a system message
equal to one (and that sends no `tools`, which templates render into the system block), or a
text prompt that begins with one, gets `shared_prefix_tokens`: the prefix's tokens as the
engine encodes the prompt (a chat's system message as its template renders it, to the end
of that message), so the engine caches those pages once for everyone and salts the rest.

Limits per tenant: `max_in_flight` (its requests inside the router at once) and
`tokens_per_s` (prompt and most output tokens a second, a bucket holding a second's worth),
both 429 with Retry-After when exceeded, and split evenly among the router's processes.

The file (JSON or TOML) is read again when its modification time changes (looked at at most
once a second, on the request path) and on SIGHUP; a file that does not parse on reload
leaves the tenants as they were and logs an error; at start it is a startup error.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from router.admission import Refused, TokenBucket, retry_after
from router.request import CHAT, COMPLETIONS, GENERATE, RequestError
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)

SECRET_ENV = "MEMSERVE_ROUTER_TENANT_SECRET"
TENANTS_ENV = "MEMSERVE_ROUTER_TENANTS"  # a path, or the file's JSON itself
RELOAD_CHECK_S = 1.0  # the file's mtime is looked at at most this often
OPERATOR = ""  # the tenant id of --api-key's holder (file ids are never empty)
# Fields only the router sets from the tenant: a client's are replaced or dropped.
NAMESPACE_FIELDS = ("cache_salt", "extra_key", "shared_prefix_tokens")
_KEY = re.compile(r"sha256:([0-9a-f]{64})")
_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = {"id", "keys", "own_salt", "max_in_flight", "tokens_per_s"}
# Texts after a public text prefix: its tokens are counted up to where none of these merges
# with its end (a tokenizer's pieces rarely reach across more than one boundary token).
_PROBES = ("a", " a", "A", "1", " 1", ".", "\n", " ", "\u4e2d", "\n\n")


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
    unknown = set(data) - {"tenants", "public_prefixes"}
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
    return TenantsFile(tenants, by_key, prefixes)


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
    return Tenant(tid, own, limit, float(rate), tuple(hashes))


def _public(entry: Any, where: str) -> PublicPrefix:
    if isinstance(entry, str):
        entry = {"text": entry}
    if not isinstance(entry, dict) or set(entry) - {"text", "sha256", "chars"}:
        raise TenantsError(f"{where}: a text, or an object with 'text' or 'sha256' (+ 'chars')")
    text = entry.get("text")
    if text is not None:
        if not isinstance(text, str) or not text or len(entry) > 1:
            raise TenantsError(f"{where}: 'text' must be a non-empty string, alone")
        return PublicPrefix(_sha(text), text, len(text))
    digest, chars = entry.get("sha256"), entry.get("chars")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest.removeprefix("sha256:")):
        raise TenantsError(f"{where}: 'sha256' must be 64 lowercase hex digits")
    if chars is not None and (isinstance(chars, bool) or not isinstance(chars, int) or chars < 1):
        raise TenantsError(f"{where}: 'chars' must be a whole number >= 1")
    return PublicPrefix(digest.removeprefix("sha256:"), None, chars)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def load_secret(given: str | None, replicas: bool) -> bytes:
    """The salts' HMAC key: --tenant-secret, else $MEMSERVE_ROUTER_TENANT_SECRET, else a
    random one (every replica would then mint other salts: logged)."""
    secret = given or os.environ.get(SECRET_ENV)
    if secret:
        return secret.encode()
    log.log(
        logging.ERROR if replicas else logging.WARNING,
        "no --tenant-secret (or $%s): salts are minted under a random secret for this run; "
        "router replicas%s mint different ones, and each restart starts tenants' caches cold",
        SECRET_ENV,
        " (--redis-url: there are some)" if replicas else "",
    )
    return secrets.token_hex(32).encode()


class Tenants:
    """Who a key is, the namespace fields its requests get, and its requests in flight.

    `source`: the file's path (reloaded when it changes) or None with `inline` text;
    `operator_key`: --api-key, which stays valid beside the tenants (every route, and
    inference as the operator's own tenant, with its own salt allowed); `share`: this
    process's part of a tenant's `max_in_flight` (--processes: n -> n // count...).
    """

    def __init__(
        self,
        source: Path | None,
        secret: bytes,
        *,
        inline: str | None = None,
        operator_key: str | None = None,
        encoder: CachedEncoder | None = None,
        process: tuple[int, int] = (0, 1),
        clock: Any = time.monotonic,
    ) -> None:
        self.source = source
        self.secret = secret
        self.encoder = encoder
        self.process = process
        self.clock = clock
        self._operator_key = operator_key.encode() if operator_key else None
        self.operator = Tenant(OPERATOR, own_salt=True)
        self._salts: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}  # tokens_per_s, by tenant id
        self.refusals: dict[str, int] = {}
        self.reloads = 0
        self.reload_errors = 0
        self._checked_at = clock()
        self._stamp: tuple[int, int, int] | None = None
        text = inline if source is None else self._read(source)
        if text is None:
            raise TenantsError("no tenants file")
        self.file = parse(text, str(source) if source is not None else TENANTS_ENV)
        self._prefixes(self.file)

    # ------------------------------------------------------------ the file

    def _read(self, path: Path) -> str:
        try:
            stat = path.stat()
            text = path.read_text()
        except OSError as exc:
            raise TenantsError(f"cannot read the tenants file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise TenantsError(f"the tenants file {path} is not UTF-8: {exc}") from None
        self._stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        return text

    def maybe_reload(self) -> None:
        """Reload when the file changed; looked at at most once every RELOAD_CHECK_S."""
        if self.source is None:
            return
        now = self.clock()
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        try:
            stat = self.source.stat()
        except OSError:
            return  # being replaced (rename): the next look finds the new one
        if (stat.st_mtime_ns, stat.st_size, stat.st_ino) != self._stamp:
            self.reload()

    def reload(self) -> bool:
        """Read the file again (SIGHUP, or it changed); on an error keep what was loaded."""
        if self.source is None:
            return False
        try:
            loaded = parse(self._read(self.source), str(self.source))
            self._prefixes(loaded)
        except (TenantsError, ValueError, TypeError) as exc:
            self.reload_errors += 1
            log.error("tenants file not reloaded, keeping the tenants loaded before: %s", exc)
            return False
        self.file = loaded
        self.reloads += 1
        log.warning(
            "tenants reloaded from %s: %d tenants, %d public prefixes",
            self.source,
            len(loaded.tenants),
            len(loaded.public),
        )
        return True

    # ------------------------------------------------------------ keys

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key this `Authorization` header carries; None: none's.

        Keys are looked up by their SHA-256: what a lookup's timing can tell is about the
        digest of the caller's own guess, which says nothing about any key. The operator's
        key is compared in constant time."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[7:].encode()
        if self._operator_key is not None and hmac.compare_digest(key, self._operator_key):
            return self.operator
        return self.file.by_key.get(hashlib.sha256(key).digest())

    def authorized(self, path: str, authorization: str | None, tenant_routes: set[str]) -> bool:
        """The operator's key: every route; a tenant's: the inference routes and the ones in
        `tenant_routes` (a tenant may not add workers nor see their addresses)."""
        self.maybe_reload()
        tenant = self.identify(authorization)
        if tenant is None:
            return False
        return tenant is self.operator or path in tenant_routes

    # ------------------------------------------------------------ namespaces

    def salt(self, tenant: Tenant) -> str:
        """The tenant's minted salt: HMAC-SHA256(secret, 'tenant:' + id), hex."""
        salt = self._salts.get(tenant.id)
        if salt is None:
            mac = hmac.new(self.secret, b"tenant:" + tenant.id.encode(), hashlib.sha256)
            salt = self._salts[tenant.id] = mac.hexdigest()
        return salt

    def namespace(self, tenant: Tenant, route: str, body: dict[str, Any], raw: bytes) -> bytes:
        """The body as the worker gets it: the tenant's cache_salt (a client's after it, if
        the tenant may choose its own), a client's extra_key under the tenant's salt,
        shared_prefix_tokens set from a public prefix and never from a client. `body` is
        changed in place; the bytes returned are what is sent."""
        client, extra = body.get("cache_salt"), body.get("extra_key")
        for name, value in (("cache_salt", client), ("extra_key", extra)):
            if value is not None and not isinstance(value, str):
                raise RequestError(400, f"'{name}' must be a string")  # as the engine says
        if tenant.tokens_per_s:
            self.charge(tenant, route, body)
        salt = self.salt(tenant)
        fields: dict[str, Any] = {
            "cache_salt": f"{salt}:{client}"
            if tenant.own_salt and isinstance(client, str) and client
            else salt
        }
        if isinstance(extra, str) and extra:
            fields["extra_key"] = f"{salt}:{extra}"
        shared = self.public_tokens(route, body)
        if shared:
            fields["shared_prefix_tokens"] = shared
        present = any(f in body for f in NAMESPACE_FIELDS)
        for f in NAMESPACE_FIELDS:
            body.pop(f, None)
        body.update(fields)
        if present:
            return msgspec.json.encode(body)
        # Nothing to take out: the fields are appended to the client's bytes, not the
        # whole body encoded again (a long prompt costs its size in the encode).
        end = raw.rstrip()
        assert end.endswith(b"}")
        added = msgspec.json.encode(fields)[1:-1]
        return end[:-1] + (b"," if len(body) > len(fields) else b"") + added + b"}"

    # ------------------------------------------------------------ public prefixes

    def _prefixes(self, loaded: TenantsFile) -> None:
        """Index the public prefixes: a chat's system message by its SHA-256; a text
        prompt's start by its length, then SHA-256; their token counts as far as known."""
        chats: dict[str, PublicPrefix] = {}
        texts: dict[int, dict[str, PublicPrefix]] = {}
        ids: list[tuple[tuple[int, ...], int]] = []
        if loaded.public and self.encoder is None:
            raise TenantsError(
                "public_prefixes need the router's tokenizer (--tokenizer-path, or workers "
                "whose /get_model_info names a local one)"
            )
        for p in loaded.public:
            chats[p.sha256] = p
            if p.chars is not None:
                texts.setdefault(p.chars, {})[p.sha256] = p
        self._chat_index = chats
        self._text_index = sorted(texts.items(), reverse=True)  # longest first
        self._chat_tokens: dict[str, int] = {}
        self._text_tokens: dict[str, int] = {}
        for p in loaded.public:
            if p.text is not None:
                self._chat_tokens[p.sha256] = self._count_chat(p.text)
                self._text_tokens[p.sha256] = n = self._count_text(p.text)
                assert self.encoder is not None
                ids.append((tuple(self.encoder.encode(p.text)[:n]), n))
        self._id_prefixes = sorted(ids, key=lambda t: -t[1])

    def public_tokens(self, route: str, body: Mapping[str, Any]) -> int:
        """`shared_prefix_tokens` for this body: the public prefix it begins with, in the
        engine's tokens (0: none)."""
        if not self._chat_index:
            return 0
        if route == CHAT:
            return self._chat_public(body)
        prompt = body.get("prompt") if route == COMPLETIONS else body.get("text")
        if route == GENERATE and prompt is None:
            prompt = body.get("input_ids")
        if isinstance(prompt, str):
            return self._text_public(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self._ids_public(prompt)
        return 0  # batches: no public prefix (each prompt would need its own)

    def _chat_public(self, body: Mapping[str, Any]) -> int:
        messages = body.get("messages")
        if body.get("tools") or not isinstance(messages, list) or not messages:
            return 0  # tools: templates render them into the system block
        first = messages[0]
        if not isinstance(first, dict) or first.get("role") != "system":
            return 0
        content = first.get("content")
        if not isinstance(content, str) or not content:
            return 0  # parts: a template may render them otherwise than the string
        digest = _sha(content)
        if digest not in self._chat_index:
            return 0
        n = self._chat_tokens.get(digest)
        if n is None:  # given by hash: counted the first time it is seen
            n = self._chat_tokens[digest] = self._count_chat(content)
        return n

    def _text_public(self, prompt: str) -> int:
        for chars, by_hash in self._text_index:
            if len(prompt) < chars:
                continue
            p = by_hash.get(_sha(prompt[:chars]))
            if p is not None:
                n = self._text_tokens.get(p.sha256)
                if n is None:
                    n = self._text_tokens[p.sha256] = self._count_text(prompt[:chars])
                return n
        return 0

    def _ids_public(self, ids: list[Any]) -> int:
        for prefix, n in self._id_prefixes:
            if n and len(ids) >= n and tuple(ids[:n]) == prefix:
                return n
        return 0

    def _count_chat(self, content: str) -> int:
        """Tokens of a system message as the chat template renders it, to the end of that
        message (0 when the template does not render it as a prefix of a longer chat)."""
        encoder = self.encoder
        assert encoder is not None
        system = {"role": "system", "content": content}
        try:
            alone = encoder.renderer.render([system], False, None)
            longer = encoder.renderer.render([system, {"role": "user", "content": "?"}], True, None)
        except (ValueError, TypeError) as exc:
            log.warning("a public system message cannot be rendered: %s", exc)
            return 0
        if not longer.startswith(alone):
            log.warning("the chat template does not render a system message as a prefix")
            return 0
        return len(encoder.encode(alone, add_special_tokens=False))

    def _count_text(self, text: str) -> int:
        """Tokens of a text prompt's public start: as far as its ids stay the same whatever
        follows it (the last piece may merge with the next text's)."""
        encoder = self.encoder
        assert encoder is not None
        base = encoder.encode(text)
        n = len(base)
        for probe in _PROBES:
            more = encoder.encode(text + probe)
            same = 0
            for a, b in zip(base, more, strict=False):
                if a != b:
                    break
                same += 1
            n = min(n, same)
        return n

    # ------------------------------------------------------------ limits

    def limit(self, tenant: Tenant) -> int:
        """This process's part of the tenant's max_in_flight (0: none)."""
        total = tenant.max_in_flight
        index, count = self.process
        if not total or count <= 1:
            return total
        return max(total // count + (1 if index < total % count else 0), 1)

    def enter(self, authorization: str | None) -> Tenant:
        """The request's tenant, counted in flight; RequestError 401 for no tenant's key (the
        file changed since the key was checked), Refused (429) at the tenant's limit."""
        tenant = self.identify(authorization)
        if tenant is None:
            raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)")
        limit = self.limit(tenant)
        now = self.in_flight.get(tenant.id, 0)
        if limit and now >= limit:
            self.refusals[tenant.id] = self.refusals.get(tenant.id, 0) + 1
            raise Refused(
                f"this API key's tenant has {now} requests in flight, its limit "
                "(max_in_flight); retry when one has finished",
                "tenant_in_flight",
                1,
            )
        self.in_flight[tenant.id] = now + 1
        return tenant

    def charge(self, tenant: Tenant, route: str, body: Mapping[str, Any]) -> None:
        """tokens_per_s: take the request's tokens (its prompt's, estimated from its length,
        and the most it may generate) from the tenant's bucket; Refused (429) while the
        bucket is in debt. A bucket holds a second's worth; one request may take it below
        zero (a prompt larger than a second's worth still goes, when the bucket is full),
        and the next waits until it has refilled past zero."""
        rate = tenant.tokens_per_s / max(self.process[1], 1)
        bucket = self._buckets.get(tenant.id)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[tenant.id] = TokenBucket(rate, rate, self.clock)
        have = bucket.available()
        if have < 0:
            self.refusals[tenant.id] = self.refusals.get(tenant.id, 0) + 1
            raise Refused(
                "this API key's tenant is past its tokens_per_s; retry later",
                "tenant_tokens_per_s",
                retry_after(-have / rate),
            )
        bucket.tokens = have - self.request_tokens(route, body)

    def request_tokens(self, route: str, body: Mapping[str, Any]) -> float:
        """The prompt's tokens (ids counted, text at the tokenizer's characters a token)
        and the most tokens the request may generate (when it says)."""
        if route == CHAT:
            messages = body.get("messages")
            chars = 0
            for m in messages if isinstance(messages, list) else ():
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    chars += sum(
                        len(str(p.get("text", ""))) for p in content if isinstance(p, dict)
                    )
            prompt: Any = chars
        else:
            prompt = body.get("prompt") if route == COMPLETIONS else body.get("text")
            if prompt is None:
                prompt = body.get("input_ids")
        ratio = self.encoder.chars_per_token if self.encoder is not None else 4.0
        if isinstance(prompt, int):
            tokens = prompt / ratio
        elif isinstance(prompt, str):
            tokens = len(prompt) / ratio
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            tokens = sum(len(p) for p in prompt if isinstance(p, str)) / ratio
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            tokens = sum(len(p) for p in prompt if isinstance(p, list))
        elif isinstance(prompt, list):
            tokens = len(prompt)
        else:
            tokens = 0
        params = body.get("sampling_params")
        out = params.get("max_new_tokens") if isinstance(params, dict) else None
        for name in ("max_completion_tokens", "max_tokens"):
            if out is None:
                out = body.get(name)
        if isinstance(out, int) and not isinstance(out, bool) and out > 0:
            tokens += out
        return max(float(tokens), 1.0)

    def exit(self, tenant: Tenant) -> None:
        n = self.in_flight.get(tenant.id, 0) - 1
        if n > 0:
            self.in_flight[tenant.id] = n
        else:
            self.in_flight.pop(tenant.id, None)

    def info(self) -> dict[str, Any]:
        """Counts for /get_server_info (no keys, no salts)."""
        return {
            "tenants": len(self.file.tenants),
            "public_prefixes": len(self.file.public),
            "in_flight": dict(self.in_flight),
            "refusals": dict(self.refusals),
            "reloads": self.reloads,
            "reload_errors": self.reload_errors,
        }


def from_args(
    path: str | None,
    secret: str | None,
    operator_key: str | None,
    encoder: CachedEncoder | None,
    replicas: bool,
    process: tuple[int, int] = (0, 1),
) -> Tenants | None:
    """--tenants (else $MEMSERVE_ROUTER_TENANTS: a path, or the JSON itself); None without
    either. SystemExit with the reason for a file that cannot be used."""
    given = path or os.environ.get(TENANTS_ENV) or None
    if given is None:
        return None
    inline = given if given.lstrip().startswith("{") else None
    try:
        return Tenants(
            None if inline is not None else Path(given),
            load_secret(secret, replicas),
            inline=inline,
            operator_key=operator_key,
            encoder=encoder,
            process=process,
        )
    except TenantsError as exc:
        raise SystemExit(f"--tenants: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m router.tenants hash-key` (the key on stdin, or prompted for) prints its
    stored form; `new-key` a fresh key and its stored form; `new-secret` a random secret."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m router.tenants", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("hash-key", help="read a key from stdin, print 'sha256:<hex>' for the file")
    sub.add_parser("new-key", help="print a new random key and its stored form")
    sub.add_parser("new-secret", help="print a random --tenant-secret")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command == "hash-key":
        if sys.stdin.isatty():
            import getpass

            key = getpass.getpass("API key: ")
        else:
            key = sys.stdin.readline().rstrip("\r\n")
        if not key:
            print("no key given", file=sys.stderr)
            return 2
        print(hash_key(key))
    elif args.command == "new-key":
        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key:    {key}\nstored: {hash_key(key)}")
    else:
        print(secrets.token_hex(32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
