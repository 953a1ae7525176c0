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

Shares per tenant: `max_tree_pages`, the pages of each of the router's prompt trees its
requests' paths may hold (shared.path_shares: a tenant over it loses its own oldest
paths, never another's), and `share`, its weight in fair admission by computed tokens when
requests wait in the router's queue (router.tenants.fair).

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
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from router.admission import Refused, TokenBucket, retry_after
from router.request import CHAT, COMPLETIONS, RequestError
from router.tenants.config import (
    PublicPrefix,
    Tenant,
    TenantsError,
    TenantsFile,
    hash_key,
    parse,
)
from router.tenants.public import PublicPrefixes
from shared.token_cache import CachedEncoder

__all__ = [
    "NAMESPACE_FIELDS",
    "OPERATOR",
    "SECRET_ENV",
    "TENANTS_ENV",
    "PublicPrefix",
    "PublicPrefixes",
    "Tenant",
    "Tenants",
    "TenantsError",
    "TenantsFile",
    "from_args",
    "hash_key",
    "load_secret",
    "parse",
]

log = logging.getLogger(__name__)

SECRET_ENV = "MEMSERVE_ROUTER_TENANT_SECRET"
TENANTS_ENV = "MEMSERVE_ROUTER_TENANTS"  # a path, or the file's JSON itself
RELOAD_CHECK_S = 1.0  # the file's mtime is looked at at most this often
OPERATOR = ""  # the tenant id of --api-key's holder (file ids are never empty)
# Fields only the router sets from the tenant: a client's are replaced or dropped.
NAMESPACE_FIELDS = ("cache_salt", "extra_key", "shared_prefix_tokens")


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
        self.public = PublicPrefixes(self.file.public, encoder)

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
            public = PublicPrefixes(loaded.public, self.encoder)
        except (TenantsError, ValueError, TypeError) as exc:
            self.reload_errors += 1
            log.error("tenants file not reloaded, keeping the tenants loaded before: %s", exc)
            return False
        self.file, self.public = loaded, public
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

    def namespace(
        self,
        tenant: Tenant,
        route: str,
        body: dict[str, Any],
        raw: bytes,
        encoder: CachedEncoder | None = None,
    ) -> bytes:
        """The body as the worker gets it: the tenant's cache_salt (a client's after it, if
        the tenant may choose its own), a client's extra_key under the tenant's salt,
        shared_prefix_tokens set from a public prefix (counted in `encoder`'s tokens, the
        request's model's; None: none is public) and never from a client. `body` is changed
        in place; the bytes returned are what is sent."""
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
        shared = self.public.tokens(route, body, encoder)
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

    # ------------------------------------------------------------ shares

    def tree_pages(self, tenant_id: str, max_pages: int) -> int:
        """Pages of each prompt tree the tenant's namespaces may hold (its max_tree_pages,
        else the file's tree_pages_per_tenant, else `max_pages` split evenly); 0, no bound,
        for the operator."""
        if tenant_id == OPERATOR:
            return 0
        tenant = self.file.tenants.get(tenant_id)
        if tenant is not None and tenant.max_tree_pages:
            return tenant.max_tree_pages
        return self.file.tree_pages_per_tenant or max(max_pages // len(self.file.tenants), 1)

    def share(self, tenant_id: str) -> float:
        """The tenant's weight in fair admission (1.0 for the operator, or one removed)."""
        tenant = self.file.tenants.get(tenant_id)
        return tenant.share if tenant is not None else 1.0

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
