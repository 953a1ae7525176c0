"""Tenants kept apart through a router with `--tenants`: the shared-prefix-cache attacks
timing audits found at API providers (Gu et al., ICML 2025), a tenant's fresh salt on every
request against another's hit ratio, and flooding tenants against their configured shares."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.reliability.client import Seen, post
from benchmarks.reliability.cluster import Cluster
from benchmarks.reliability.faults import Scenario, Settings, finish
from benchmarks.reliability.report import BOUND_S, FaultResult
from benchmarks.reliability.tenant_shares import (
    FLOODER_PAGES,
    FLOODS,
    MAX_TREE,
    Generate,
    computed_split,
    flood_tenants,
    hit_ratio,
    within_share,
)
from localrun.processes import Server, auth_headers
from router.tenants import hash_key

SECRET = "reliability-tenant-secret"
KEYS = {"a": "sk-reliability-a", "b": "sk-reliability-b"}
SHARE_KEYS = {"a": "sk-share-a", "b": "sk-share-b"}
_COUNTING = threading.Lock()
PUBLIC = (
    "You are the shared assistant of the Example gateway. Answer questions about orders, "
    "invoices and parcels in short sentences and never invent an order number. "
) * 4
PAGE = 16  # the worker's default page


def unbroken(scenario: str, injected: str, expected: str) -> FaultResult:
    """A tenants row: nothing is broken, so there is nothing to heal."""
    return FaultResult(
        scenario, injected, expected=expected, healed=True, healed_how="nothing to heal"
    )


def router_with(c: Cluster, workers: list[Server], tenants: dict[str, Any], *extra: str) -> Server:
    """A router over `workers` with the tenants file `tenants` and the suite's secret."""
    path = c.logs / f"tenants-{len(c.launches)}.json"
    path.write_text(json.dumps(tenants))
    return c.colocated_router(workers, "--tenants", str(path), "--tenant-secret", SECRET, *extra)


def minted(tenant: str) -> str:
    """The salt the router mints for `tenant` (what a client who learned it would send)."""
    return hmac.new(SECRET.encode(), b"tenant:" + tenant.encode(), hashlib.sha256).hexdigest()


def bodies(text: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same prompt on every inference route, in both prompt forms where there are two."""
    sampling = {"sampling_params": {"max_new_tokens": 2}}
    return {
        "/generate text": ("/generate", {"text": text, **sampling}),
        "/v1/completions text": ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        "/v1/chat/completions": (
            "/v1/chat/completions",
            # (as the system message: the template's default one would start every chat
            # without one, cached once per tenant)
            {"messages": [{"role": "system", "content": text}], "max_tokens": 2},
        ),
    }


def cached(seen: Seen) -> int | None:
    body = seen.body
    if seen.status != 200 or not isinstance(body, dict):
        return None
    if "meta_info" in body:
        return int(body["meta_info"]["cached_tokens"])
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def counted(result: FaultResult, url: str, body: dict[str, Any], key: str) -> Seen:
    """One request with a tenant's key, counted in the row."""
    seen = post(url, body, BOUND_S, headers=auth_headers(key))
    with _COUNTING:  # (the fairness row's clients are threads)
        result.requests += 1
        result.answered += seen.ok
        result.clear_errors += seen.clear_error
        result.slowest_s = max(result.slowest_s, seen.seconds)
    return seen


def generator(result: FaultResult, url: str) -> Generate:
    """tenant_shares' /generate, counted in the row; an answer without meta_info raises."""

    def generate(key: str, tokens: list[int], out: int, **fields: Any) -> dict[str, Any]:
        body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": out}, **fields}
        seen = counted(result, url + "/generate", body, key)
        if seen.status != 200 or not isinstance(seen.body, dict):
            raise RuntimeError(f"/generate answered {seen.status}: {str(seen.body)[:200]}")
        return dict(seen.body["meta_info"])

    return generate


def tenants_isolated(c: Cluster, s: Settings) -> FaultResult:
    """Another tenant's identical prompt, a copied salt and a public prefix, on every route:
    what each tenant's requests report cached."""
    result = unbroken(
        "tenants kept apart",
        "tenant B sends tenant A's prompts on every route, then with A's salt copied; both "
        "send a public system prompt with private text after it",
        "B's copies report 0 cached tokens; A's own repeats hit; the public "
        "prompt hits across tenants, the private text after it does not",
    )
    (worker,) = c.workers(1, time_scale=0)
    tenants = [
        {"id": "a", "keys": [hash_key(KEYS["a"])], "own_salt": True},
        {"id": "b", "keys": [hash_key(KEYS["b"])]},
    ]
    router = router_with(c, [worker], {"tenants": tenants, "public_prefixes": [PUBLIC]})
    failures: list[str] = []

    def send(key: str, route: str, body: dict[str, Any]) -> int | None:
        return cached(counted(result, router.url + route, body, key))

    def check(what: str, got: int | None, ok: Callable[[int], bool]) -> None:
        if got is None or not ok(got):
            failures.append(f"{what}: {got}")

    for name in bodies(""):
        route, body = bodies(f"{uuid.uuid4().hex} {PUBLIC[:300]} {s.requests}")[name]
        check(f"{name}: B first", send(KEYS["b"], route, body), lambda n: n == 0)
        check(f"{name}: A, B's prompt", send(KEYS["a"], route, body), lambda n: n == 0)
        check(f"{name}: A again", send(KEYS["a"], route, body), lambda n: n >= PAGE)
        route, body = bodies(f"{uuid.uuid4().hex} {PUBLIC[:300]}")[name]
        send(KEYS["a"], route, body)  # A's prompt, then B with A's salt copied
        copied = {**body, "cache_salt": minted("a")}
        check(f"{name}: B with A's salt", send(KEYS["b"], route, copied), lambda n: n == 0)
    own = dict(bodies(f"{uuid.uuid4().hex} private of A")["/generate text"][1], cache_salt="x")
    send(KEYS["a"], "/generate", own)
    check("A's own salt, again", send(KEYS["a"], "/generate", own), lambda n: n >= PAGE)
    chat = "/v1/chat/completions"

    def with_public(private: str) -> dict[str, Any]:
        system = {"role": "system", "content": PUBLIC}
        return {"messages": [system, {"role": "user", "content": private}], "max_tokens": 2}

    a_full = with_public(f"{uuid.uuid4().hex} A's order 1234 of 56 parcels")
    send(KEYS["a"], chat, a_full)
    repeat = send(KEYS["a"], chat, a_full) or 0
    shared = send(KEYS["b"], chat, with_public(f"{uuid.uuid4().hex} B's question"))
    check("public prompt, B after A", shared, lambda n: PAGE <= n < repeat)
    b_copy = send(KEYS["b"], chat, a_full)  # A's private text after the public prompt
    check("A's private text, B", b_copy, lambda n: n == (shared or 0))
    result.client_saw = (
        f"{result.answered}/{result.requests} answered; cached tokens of B's copies 0 on "
        f"every route; public prompt {shared} cached for B (A's whole repeat {repeat})"
        if not failures
        else "; ".join(failures[:4])
    )
    result.expectation_met = not failures and result.answered == result.requests
    return finish(result, [worker])


def tenant_fresh_salts(c: Cluster, s: Settings) -> FaultResult:
    """A tenant's fresh salt on every request against another tenant's hit ratio (its
    paths in the prompt trees, bounded by the flooder's max_tree_pages)."""
    result = unbroken(
        "a tenant's fresh salt on every request",
        f"tenant B (own salts) sends a new cache_salt on each of {FLOODS} requests before "
        "each of tenant A's rounds, through a router whose prompt trees hold "
        f"{MAX_TREE} pages",
        "A's hit ratio within 2 points of its hit ratio without the flood: B over "
        f"its share ({FLOODER_PAGES} pages) loses its own paths, never A's",
    )
    workers = c.workers(2, "--max-total-tokens", "65536", time_scale=2)
    tenants = flood_tenants(SHARE_KEYS, FLOODER_PAGES)
    router = router_with(c, workers, tenants, "--max-tree-size", str(MAX_TREE))
    generate = generator(result, router.url)
    quiet = hit_ratio(router.url, generate, SHARE_KEYS, 1, flood=False)
    flooded = hit_ratio(router.url, generate, SHARE_KEYS, 2, flood=True)
    result.measured = {"hit_ratio_quiet": quiet, "hit_ratio_flooded": flooded}
    result.client_saw = (
        f"{result.answered}/{result.requests} answered; A's hit ratio {quiet:.3f} without "
        f"B's flood, {flooded:.3f} with it"
    )
    result.expectation_met = flooded >= quiet - 0.02 and result.answered == result.requests
    return finish(result, workers)


def tenant_fair_admission(c: Cluster, s: Settings) -> FaultResult:
    """Two tenants flooding a router admitting one request at a time: the computed tokens
    each gets, against its configured share."""
    shares = {"a": 2.0, "b": 1.0}
    result = unbroken(
        "tenants' fair share at saturation",
        "tenants A (share 2) and B (share 1, twice A's clients) flood a router admitting "
        "one request at a time (--max-concurrent-requests 1)",
        "each tenant's computed prompt tokens within 10% of its share (A 2/3, "
        "B 1/3); first come, first served would give B two thirds",
    )
    workers = c.workers(1, time_scale=2)
    tenants = [
        {"id": t, "keys": [hash_key(SHARE_KEYS[t])], "share": shares[t]} for t in sorted(shares)
    ]
    router = router_with(c, workers, {"tenants": tenants}, "--max-concurrent-requests", "1")
    clients = {"a": (SHARE_KEYS["a"], 5), "b": (SHARE_KEYS["b"], 10)}
    computed = computed_split(generator(result, router.url), clients, 90 * 128)
    total = sum(computed.values()) or 1
    result.measured = {f"computed_{t}": float(n) for t, n in computed.items()}
    result.client_saw = (
        f"{result.answered}/{result.requests} answered; computed tokens "
        + ", ".join(f"{t} {n} ({n / total:.1%})" for t, n in sorted(computed.items()))
    )
    result.expectation_met = within_share(computed, shares) and result.answered == result.requests
    return finish(result, workers)


SCENARIOS: list[Scenario] = [
    tenants_isolated,
    tenant_fresh_salts,
    tenant_fair_admission,
]
