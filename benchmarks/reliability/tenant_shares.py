"""Tenants' shares under attack through a router, for the reliability rows and
tests/router/tenants: a fresh salt on every request against another tenant's hit ratio, and
a flooding tenant against the others' part of the computed tokens."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from localrun.processes import auth_headers
from router.tenants import hash_key

FLOODS = 30  # the fresh-salt tenant's requests before each of the victim's rounds
MAX_TREE = 128  # the router's pages per tree: the victim's paths and the shares fit
FLOODER_PAGES = 16  # the flooding tenant's max_tree_pages
DOCS, DOC_TOKENS = 8, 112  # the victim's documents, each asked in two rounds


class Generate(Protocol):
    def __call__(self, key: str, tokens: list[int], out: int, **fields: Any) -> dict[str, Any]:
        """One /generate of `tokens` with `key`; its meta_info."""


def ids(seed: int, n: int) -> list[int]:
    """`n` token ids, different per seed (no prefix shared across seeds)."""
    return [(seed * 7919 + i * 104729) % 30000 + 100 for i in range(n)]


def flood_tenants(keys: Mapping[str, str], flooder_pages: int) -> dict[str, Any]:
    """The tenants file: victim `a` and flooder `b` (who may choose its salts)."""
    return {
        "tenants": [
            {"id": "a", "keys": [hash_key(keys["a"])], "max_tree_pages": 96},
            {
                "id": "b",
                "keys": [hash_key(keys["b"])],
                "own_salt": True,
                "max_tree_pages": flooder_pages,
            },
        ]
    }


def hit_ratio(
    url: str, generate: Generate, keys: Mapping[str, str], seed: int, flood: bool
) -> float:
    """`a`'s hit ratio over two rounds of its DOCS documents, with or without `b` sending a
    fresh salt on each of FLOODS requests before each round. The documents are placed while
    earlier ones are still answered, so they spread over the workers by load; a document the
    trees forgot then goes where any request would, and misses where it is not."""
    docs = [ids(seed * 10 + i, DOC_TOKENS) for i in range(DOCS)]
    with contextlib.ExitStack() as placing:
        for doc in docs:
            placing.enter_context(busy(url, keys["a"], doc, 30))
    prompt = cached = 0
    for r in range(2):
        if flood:
            for i in range(FLOODS):
                salt = f"fresh-{seed}-{r}-{i}"
                generate(keys["b"], ids(seed * 1000 + r * 100 + i, DOC_TOKENS), 1, cache_salt=salt)
        for doc in docs:
            meta = generate(keys["a"], doc, 2)
            prompt += meta["prompt_tokens"]
            cached += meta["cached_tokens"]
    return cached / prompt


@contextlib.contextmanager
def busy(url: str, key: str, tokens: list[int], out: int) -> Iterator[None]:
    """A streamed /generate in flight (placed: its first token came) while the block runs."""
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": out}, "stream": True}
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), auth_headers(key)
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        stream.readline()  # the first event
        yield
        stream.read()


def computed_split(
    generate: Generate, clients: Mapping[str, tuple[str, int]], total_tokens: int
) -> dict[str, int]:
    """Each tenant's computed (not cached) prompt tokens while all flood (`clients`: tenant
    -> (key, concurrent clients)), until `total_tokens` (then the queue is not saturated)."""
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
