"""Tenants kept apart through a router with `--tenants`: the shared-prefix-cache attacks
timing audits found at API providers (Gu et al., ICML 2025), also through two router replicas
and a MemPool pull off a busy worker, a tenant's fresh salt on every request against
another's hit ratio, and flooding tenants against their configured shares."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
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
from localrun.processes import Server, auth_headers, redis_url, start_redis
from router.tenants import hash_key
from shared.tokenizer import ChatTokenizer

SECRET = "reliability-tenant-secret"
KEYS = {"a": "sk-reliability-a", "b": "sk-reliability-b"}
SHARE_KEYS = {"a": "sk-share-a", "b": "sk-share-b"}
_COUNTING = threading.Lock()
PUBLIC = (
    "You are the shared assistant of the Example gateway. Answer questions about orders, "
    "invoices and parcels in short sentences and never invent an order number. "
) * 4
PAGE = 16  # the worker's default page
# The replicas row's workers: 20x slower than the modelled H100, so that a long prompt keeps
# its worker busy for seconds (3,800 tokens: about 3 s) while other requests are routed.
SLOW_SCALE = 20.0
LONG_WORDS = 3000  # a private text that fills most of the workers' 4,096-token context


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


def meta(seen: Seen) -> dict[str, Any] | None:
    """A /generate answer's meta_info (None for anything else)."""
    body = seen.body
    if seen.status != 200 or not isinstance(body, dict) or "meta_info" not in body:
        return None
    return dict(body["meta_info"])


def public_tokens(c: Cluster, prompt: str) -> int:
    """How many of `prompt`'s tokens (the worker's tokenizer) are PUBLIC's: the tokens the
    two encodings share."""
    tokenizer = ChatTokenizer(c.model_dir)
    full, alone = tokenizer.encode(prompt), tokenizer.encode(PUBLIC)
    return next(
        (i for i, (x, y) in enumerate(zip(full, alone, strict=False)) if x != y),
        min(len(full), len(alone)),
    )


def tenants_across_replicas(c: Cluster, s: Settings) -> FaultResult:
    """The same attacks through two router replicas that share their prompt trees (redis),
    and a move off a busy worker by a MemPool pull: what the pull brings each tenant."""
    result = unbroken(
        "tenants kept apart through replicas and pulls",
        "two router replicas share one redis and two pulling workers; while the worker "
        "holding tenant A's prompt (a public prefix, then A's text) is busy with A's long "
        "prompt, B and then A send that prompt through the other replica; then B sends A's "
        "prompts on every route, and with A's salt copied, through the replica A did not use",
        "moved off the busy worker, B pulls the public prefix only and A its whole prompt; "
        "B's copies report 0 cached tokens through either replica, A's repeats hit through "
        "the other one",
    )
    redis = start_redis(c.logs / "tenants-redis.log")
    c.servers.append(redis)
    workers = c.workers(2, "--enable-mempool-pull", time_scale=SLOW_SCALE)
    tenants = [
        {"id": "a", "keys": [hash_key(KEYS["a"])]},
        {"id": "b", "keys": [hash_key(KEYS["b"])]},
    ]
    doc = {"tenants": tenants, "public_prefixes": [PUBLIC]}
    shared = ("--redis-url", redis_url(redis))
    r1 = router_with(c, workers, doc, *shared, "--replica-id", "r1")
    r2 = router_with(c, workers, doc, *shared, "--replica-id", "r2")
    failures: list[str] = []

    def generate(router: Server, key: str, text: str, **fields: Any) -> dict[str, Any]:
        body = {"text": text, "sampling_params": {"max_new_tokens": 2}, **fields}
        got = meta(counted(result, router.url + "/generate", body, key))
        if got is None:
            failures.append(f"no answer for {text[:40]!r}")
            return {"cached_tokens": -1, "pulled_tokens": -1}
        return got

    # A's prompt, then A's long one on the same worker (the holder of the public prefix)
    private = " ".join(f"parcel {i} of order 1234," for i in range(12))
    prompt = f"{PUBLIC}{uuid.uuid4().hex} A's {private} due on Monday."
    first = generate(r1, KEYS["a"], prompt)
    long = f"{PUBLIC}{uuid.uuid4().hex} " + " ".join(["parcel"] * LONG_WORDS)
    busy = threading.Thread(target=generate, args=(r1, KEYS["a"], long))
    busy.start()
    time.sleep(0.5)  # sent: both replicas count it in flight on the holder
    moved_b = generate(r2, KEYS["b"], prompt)  # A's text after the public prefix, as B
    moved_a = generate(r2, KEYS["a"], prompt)
    busy.join()
    public = public_tokens(c, prompt)
    if first["cached_tokens"] != 0:
        failures.append(f"A's first prompt: {first['cached_tokens']} cached")
    # the public prefix's whole pages, pulled; not a token of A's text after it
    b_pulled = moved_b["pulled_tokens"]
    if moved_b["cached_tokens"] != 0 or not public - 2 * PAGE < b_pulled <= public:
        failures.append(
            f"B moved: {moved_b['pulled_tokens']} pulled, {moved_b['cached_tokens']} cached "
            f"(the public prefix: {public} tokens)"
        )
    if not moved_a["pulled_tokens"] + moved_a["cached_tokens"] > public + PAGE:
        failures.append(
            f"A moved: {moved_a['pulled_tokens']} pulled, {moved_a['cached_tokens']} cached"
        )
    for name in bodies(""):
        route, body = bodies(f"{uuid.uuid4().hex} {PUBLIC[:300]}")[name]
        for name_r, router, key, least in (
            ("r1", r1, "a", 0),
            ("r2", r2, "b", 0),
            ("r2", r2, "a", PAGE),
        ):
            got = cached(counted(result, router.url + route, body, KEYS[key]))
            if got is None or (got < least if least else got != 0):
                failures.append(f"{name}, {key} through {name_r}: {got}")
        route, body = bodies(f"{uuid.uuid4().hex} {PUBLIC[:300]}")[name]
        counted(result, r1.url + route, body, KEYS["a"])  # A's alone, then B with A's salt
        copied = {**body, "cache_salt": minted("a")}
        got = cached(counted(result, r2.url + route, copied, KEYS["b"]))
        if got != 0:
            failures.append(f"{name}, B with A's salt: {got}")
    result.measured = {
        "b_pulled": float(moved_b["pulled_tokens"]),
        "a_pulled": float(moved_a["pulled_tokens"]),
        "a_cached": float(moved_a["cached_tokens"]),
    }
    result.client_saw = (
        f"{result.answered}/{result.requests} answered; off the busy worker B pulled "
        f"{moved_b['pulled_tokens']} tokens (the public prefix) and A "
        f"{moved_a['pulled_tokens']} pulled + {moved_a['cached_tokens']} cached (its whole "
        "prompt); B's copies 0 cached through either replica, A's repeats hit"
        if not failures
        else "; ".join(failures[:4])
    )
    result.expectation_met = not failures and result.answered == result.requests
    return finish(result, workers)


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
    tenants_across_replicas,
    tenant_fresh_salts,
    tenant_fair_admission,
]
