"""Tenants' shares under attack, measured through a router (the reliability table's rows, and
tests/router/tenants): a fresh salt on every request of one tenant against another tenant's
hit ratio, and a flooding tenant against the others' part of the computed tokens.

`Generate(key, tokens, max_new_tokens, **fields)` sends one `/generate` of token ids with a
tenant's key and returns its answer's `meta_info` (the caller counts what it wants).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from router.tenants import hash_key

FLOODS = 30  # the fresh-salt tenant's requests before each of the victim's rounds
MAX_TREE = 96  # the router's pages per tree: the victim's paths and the shares fit
FLOODER_PAGES = 16  # the flooding tenant's max_tree_pages


class Generate(Protocol):
    def __call__(self, key: str, tokens: list[int], out: int, **fields: Any) -> dict[str, Any]:
        """One /generate of `tokens` with `key`; its meta_info."""


def ids(seed: int, n: int) -> list[int]:
    """`n` token ids, different per seed (no prefix shared across seeds)."""
    return [(seed * 7919 + i * 104729) % 30000 + 100 for i in range(n)]


def flood_tenants(keys: Mapping[str, str], flooder_pages: int) -> dict[str, Any]:
    """The tenants file: victim `a`, flooder `b` (may choose its salts), `c` who keeps the
    first worker busy while `a` places its documents."""
    return {
        "tenants": [
            {"id": "a", "keys": [hash_key(keys["a"])], "max_tree_pages": 64},
            {
                "id": "b",
                "keys": [hash_key(keys["b"])],
                "own_salt": True,
                "max_tree_pages": flooder_pages,
            },
            {"id": "c", "keys": [hash_key(keys["c"])], "max_tree_pages": 16},
        ]
    }


def hit_ratio(generate: Generate, keys: Mapping[str, str], seed: int, flood: bool) -> float:
    """`a`'s hit ratio over three rounds of its four documents, placed on the router's
    second worker (the first busy with `c`'s long request meanwhile), with or without `b`
    sending a fresh salt on each of FLOODS requests before each round. A request the trees
    know nothing about goes to the first worker (both idle): without its path in the trees,
    `a`'s document misses."""
    docs = [ids(seed * 10 + i, 112) for i in range(4)]
    busy = threading.Thread(target=generate, args=(keys["c"], ids(seed * 10 + 9, 96), 60))
    busy.start()
    time.sleep(0.2)
    for doc in docs:
        generate(keys["a"], doc, 2)
    busy.join()
    prompt = cached = 0
    for r in range(3):
        if flood:
            for i in range(FLOODS):
                salt = f"fresh-{seed}-{r}-{i}"
                generate(keys["b"], ids(seed * 1000 + r * 100 + i, 112), 1, cache_salt=salt)
        for doc in docs:
            meta = generate(keys["a"], doc, 2)
            prompt += meta["prompt_tokens"]
            cached += meta["cached_tokens"]
    return cached / prompt


def computed_split(
    generate: Generate, clients: Mapping[str, tuple[str, int]], total_tokens: int
) -> dict[str, int]:
    """Each tenant's computed (not cached) prompt tokens while all of them flood: tenant ->
    (key, concurrent clients); counted until `total_tokens` were computed (the queue
    draining after that is no longer saturated)."""
    computed = dict.fromkeys(clients, 0)
    stop = threading.Event()
    lock = threading.Lock()
    counter = iter(range(1_000_000))
    errors: list[BaseException] = []

    def client(tenant: str, key: str) -> None:
        try:
            while not stop.is_set():
                meta = generate(key, ids(next(counter) + 5000, 128), 1)
                with lock:
                    if stop.is_set():
                        return
                    computed[tenant] += meta["prompt_tokens"] - meta["cached_tokens"]
                    if sum(computed.values()) >= total_tokens:
                        stop.set()
        except BaseException as exc:  # the caller sees it
            errors.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=client, args=(tenant, key))
        for tenant, (key, n) in clients.items()
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return computed


def within_share(computed: Mapping[str, int], shares: Mapping[str, float]) -> bool:
    """Every tenant's part of the computed tokens within 10% of its configured share."""
    total = sum(computed.values()) or 1
    weights = sum(shares.values())
    return all(
        abs(computed[t] / total - shares[t] / weights) <= 0.1 * shares[t] / weights for t in shares
    )
