"""MemPool micro-benchmarks: the analogue of MemServe's figure 9, plus layout and memory.

Block alloc/free, index insert/match/evict/expire, the native index tree alone, network calls
per layout and index memory; what each figure means: docs/benchmarks/mempool.md. Targets are
reported, never asserted: the machines are shared and noisy.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import multiprocessing
import os
import random
import resource
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.progress import Progress

import mempool
from benchmarks.harness import benchmark_main, percentile, progress_bar, rss_mib, step
from benchmarks.report.figures import pyplot, save
from benchmarks.report.page import write_results
from benchmarks.report.targets import check
from mempool import (
    KVBlockSpec,
    Layout,
    MemPool,
    RadixTree,
    aggregate,
    disaggregate,
    transfer_segments,
)

NAME = "mempool_micro"
T = TypeVar("T")
SEED = 20240609
VOCAB = 49152  # token ids are drawn from 0..VOCAB-1
PAGE = 16
SYSTEM_TOKENS = 1024  # the shared system prompt every conversation starts with
PROMPT_TOKENS = 4096
ALLOC_BLOCKS = 256  # blocks per alloc call for the headline figure (a 4K prompt, 1 block/page)
POOL_BLOCKS = 65536
PRELOAD_TOKENS = 100_000
ALLOC_SWEEP = (8, 16, 32, 64, 128, 256, 512, 1024)
PROMPT_SWEEP = (256, 512, 1024, 2048, 4096, 8192, 16384)
MEMORY_SYSTEM_PROMPTS = 8  # distinct applications sharing the instance in the memory test

# 1 KiB aggregated blocks: a 64 MiB arena for 65,536 blocks.
BENCH_SPEC = KVBlockSpec(layers=2, kv_heads=1, head_dim=8, dtype="float16", page_size=PAGE)
# 64-byte blocks: the memory test's arena stays a few MiB while it indexes a million tokens.
TINY_SPEC = KVBlockSpec(layers=1, kv_heads=1, head_dim=2, dtype="int8", page_size=PAGE)
LLAMA2_13B = KVBlockSpec(layers=40, kv_heads=40, head_dim=128, dtype="bfloat16", page_size=PAGE)

MEMSERVE_ALLOC_NS_PER_BLOCK = 800.0  # MemServe (arXiv 2406.17565) figure 9, about 800 ns/block
MEMSERVE_INSERT_4K_US = 700.0  # ... and at most 700 us to insert a 4K-token prompt

TARGET_ALLOC_NS_PER_BLOCK = 100.0
TARGET_INSERT_4K_US = 100.0
TARGET_MATCH_4K_US = 50.0
TARGET_INDEX_MIB_PER_MTOK = 64.0
TARGET_EVICT_16_US = 20.0  # at every measured size: eviction must not grow with the index
# the index tree alone (issue 34: the tree in C++)
TARGET_TREE_INSERT_4K_US = 25.0
TARGET_TREE_MATCH_4K_US = 10.0
TARGET_TREE_EVICT_16_US = 5.0

EVICT_BLOCKS = 16  # what an allocation that falls short asks the pool to free
HOLDERS = ("w0", "w1", "w2", "w3")  # instances of the holders tree (the router's view)
STALE_STEP = 0.01  # each timed expire drops the next-oldest 1% of the holder entries

# The headline table, in page order: a figure and its unit.
HEADLINE = (
    ("alloc_ns_per_block", "ns/block"),
    ("free_ns_per_block", "ns/block"),
    ("alloc_p50_us", "µs/call (256 blocks)"),
    ("free_p50_us", "µs/call (256 blocks)"),
    ("insert_4k_us", "µs"),
    ("match_4k_us", "µs"),
    ("match_4k_partial_us", "µs"),
    ("insert_4k_after_match_us", "µs"),
    ("delete_4k_us", "µs"),
    ("tree_insert_4k_us", "µs, the index tree alone, tokens as a list"),
    ("tree_insert_4k_array_us", "µs, tokens as array('I')"),
    ("tree_match_4k_us", "µs, the index tree alone, tokens as a list"),
    ("tree_match_4k_array_us", "µs, tokens as array('I')"),
    ("tree_delete_4k_us", "µs, the index tree alone"),
    ("aggregate_calls_ratio", "calls/calls"),
    ("layers", "layers"),
    ("layout_roundtrip_exact", "bool"),
    ("index_rss_mib_per_million_tokens", "MiB/M tokens"),
    ("index_tracemalloc_mib_per_million_tokens", "MiB/M tokens"),
    ("memory_tokens_measured", "tokens"),
)
# Then per index size, each named with its size (evict_16_us_1m); {t}: the size in tokens.
PER_SIZE = (
    ("evict_16_us", "µs, MemPool.evict(16) at {t}"),
    ("evict_16_p90_us", "µs"),
    ("expire_us", "µs, expire 1% of entries at {t}"),
    ("scale_build_s", "s, both indexes built"),
    ("scale_peak_rss_mib", "MiB, the process's peak"),
    ("tree_evict_16_us", "µs, the index tree's evict(16) at {t}"),
    ("tree_bytes_per_page", "B per cached page, native tree"),
    ("holders_tree_bytes_per_page", "B per page, holders tree"),
    ("python_tree_bytes_per_page", "B per page, Python tree"),  # with the repository's tests
)


@dataclass(frozen=True)
class Settings:
    """Repetition counts, the full run's by default: quick mode trades precision for speed."""

    quick: bool = False
    alloc_batches: int = 101  # batches per alloc/free point; the median batch is reported
    alloc_calls: int = 32  # calls per batch (32 x 1024 blocks still fits the pool)
    single_reps: int = 5000  # individually timed alloc/free calls, for p50/p99 per call
    index_reps: int = 1000  # insert and match repetitions per prompt length
    memory_tokens: int = 1_000_000  # cached tokens the memory test builds
    scale_tokens: tuple[int, ...] = (1_000_000, 10_000_000)  # sizes for evict/expire at scale
    evict_reps: int = 101  # individually timed evict(16) calls per size
    expire_reps: int = 10  # individually timed expire calls per size


FULL = Settings()
QUICK = Settings(True, 15, 32, 1000, 80, 200_000, (1_000_000,), evict_reps=51, expire_reps=5)


# --------------------------------------------------------------------------- workload


class Traffic:
    """Seeded chat-like token streams: shared system prompts, then distinct multi-turn chats."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        """`n` random token ids as a Python list, which is what an engine passes."""
        return [v % VOCAB for v in array("I", self.rng.randbytes(4 * n))]

    def prompt(self, prefix: list[int], n: int) -> list[int]:
        """A fresh `n`-token prompt after `prefix`."""
        return prefix + self.tokens(n - len(prefix))

    def systems(self) -> list[list[int]]:
        """The system prompts of the memory and scale tests' applications."""
        return [self.tokens(SYSTEM_TOKENS) for _ in range(MEMORY_SYSTEM_PROMPTS)]

    def conversation(self, system: list[int]) -> Iterator[list[int]]:
        """The successive prompts of one chat: each turn extends the previous prompt."""
        prompt = system + self.tokens(self.rng.randrange(512, 2048))
        for _ in range(self.rng.randrange(1, 5)):
            yield prompt
            prompt = prompt + self.tokens(self.rng.randrange(64, 768))


def shared_prefix(system: list[int], n: int) -> list[int]:
    """A quarter of the prompt (at most the whole system prompt) is shared, as in the 4K case."""
    return system[: min(len(system), n // 4)]


def cached_tokens(pool: MemPool) -> int:
    return int(pool.stats()["cached_tokens"])


def blocks_for(pool: MemPool, tokens: int) -> int:
    """The blocks of a prompt's whole pages."""
    return tokens // PAGE * pool.blocks_per_page


def fill_index(
    pool: MemPool, traffic: Traffic, systems: Sequence[list[int]], target_tokens: int
) -> tuple[int, float]:
    """Insert whole conversations until the index caches `target_tokens`: how many, and the
    seconds it took. Each turn allocates blocks for all its pages and inserts them, as an
    engine does without a prior match (the pool frees those of pages it had cached)."""
    started = time.perf_counter()
    conversations = 0
    while (before := cached_tokens(pool)) < target_tokens:
        for prompt in traffic.conversation(traffic.rng.choice(systems)):
            pool.insert(prompt, pool.alloc_blocks(blocks_for(pool, len(prompt))))
        conversations += 1
        if cached_tokens(pool) <= before:  # a broken index would otherwise loop for ever
            raise RuntimeError(f"the index stopped growing at {before} cached tokens")
    return conversations, time.perf_counter() - started


def fill_tree(tree: Any, traffic: Traffic, systems: Sequence[list[int]], target: int) -> int:
    """`fill_index` for a bare index tree (one address per page); returns the next unused
    address."""
    addr = 0
    while tree.num_pages * PAGE < target:
        for prompt in traffic.conversation(traffic.rng.choice(systems)):
            pages = len(prompt) // PAGE
            tree.insert(prompt, range(addr, addr + pages))
            addr += pages
    return addr


def median_us(samples_ns: Sequence[float]) -> float:
    return statistics.median(samples_ns) / 1e3


def percentile_us(samples_ns: Sequence[float], q: float) -> float:
    return percentile(samples_ns, q) / 1e3


def columns(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """One list per timed call from one tuple of timings per repetition."""
    return [list(column) for column in zip(*rows, strict=True)]


def summary(samples: Mapping[str, Sequence[float]], p90: Sequence[str] = ()) -> dict[str, float]:
    """`{name}_us`: the median of each name's samples (ns); then `{name}_p90_us` for `p90`."""
    medians = {f"{name}_us": median_us(ns) for name, ns in samples.items()}
    return medians | {f"{name}_p90_us": percentile_us(samples[name], 0.9) for name in p90}


def calibration_us(reps: int = 300) -> float:
    """Median time of a fixed C workload (a 4,096-int list to array('I')), taken between the
    phases: on shared VMs the same code can run at half speed for seconds at a time."""
    tokens = list(range(1000, 1000 + PROMPT_TOKENS))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        array("I", tokens)
        samples.append(time.perf_counter_ns() - t0)
    return median_us(samples)


# --------------------------------------------------------------------------- allocation and index


def time_alloc_free(pool: MemPool, blocks: int, settings: Settings) -> dict[str, float]:
    """Per call, the median batch of `alloc_calls` allocations, then of their frees (batches
    keep the clock's own cost, tens of ns, out of sub-microsecond calls)."""
    calls = settings.alloc_calls
    rows = []
    for batch in range(settings.alloc_batches + 1):
        t0 = time.perf_counter_ns()
        held = [pool.alloc_blocks(blocks) for _ in range(calls)]
        t1 = time.perf_counter_ns()
        for addrs in held:
            pool.free_mem(addrs)
        t2 = time.perf_counter_ns()
        if batch:  # the first batch warms caches and is dropped
            rows.append(((t1 - t0) / calls, (t2 - t1) / calls))
    alloc_ns, free_ns = columns(rows)
    return {"blocks": blocks, "alloc_us": median_us(alloc_ns), "free_us": median_us(free_ns)}


def time_single_calls(pool: MemPool, blocks: int, reps: int) -> list[list[float]]:
    """Each alloc and free timed on its own, for the per-call distribution (p50, p99)."""
    rows = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        addrs = pool.alloc_blocks(blocks)
        t1 = time.perf_counter_ns()
        pool.free_mem(addrs)
        t2 = time.perf_counter_ns()
        rows.append((t1 - t0, t2 - t1))
    return columns(rows)


def index_point(
    pool: MemPool, traffic: Traffic, system: list[int], n: int, reps: int
) -> dict[str, float]:
    """Median latencies for n-token prompts against the preloaded index: insert fresh ones,
    deleting each after (allocation untimed), then match a cached one (full hit) and one
    sharing its first half. The shared prefix makes an insert walk a cached path and add a
    leaf; the untimed first partial match splits the cached node, as repeated traffic would."""
    prefix = shared_prefix(system, n)
    edits = []
    for _ in range(reps):
        tokens = traffic.prompt(prefix, n)
        addrs = pool.alloc_blocks(blocks_for(pool, n))
        t0 = time.perf_counter_ns()
        pool.insert(tokens, addrs)
        t1 = time.perf_counter_ns()
        pool.delete(tokens)
        t2 = time.perf_counter_ns()
        edits.append((t1 - t0, t2 - t1))
    cached = traffic.prompt(prefix, n)
    pool.insert(cached, pool.alloc_blocks(blocks_for(pool, n)))
    partial = cached[: n // 2] + traffic.tokens(n - n // 2)
    hits = (pool.match(cached).num_tokens, pool.match(partial).num_tokens)
    if hits != (n, n // 2):
        raise RuntimeError(f"match of {n}-token prompts hit {hits}, expected {(n, n // 2)}")
    matches = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        pool.match(cached)
        t1 = time.perf_counter_ns()
        pool.match(partial)
        t2 = time.perf_counter_ns()
        matches.append((t1 - t0, t2 - t1))
    pool.delete(cached)
    names = ("insert", "delete", "match", "match_partial")
    timed = dict(zip(names, columns(edits) + columns(matches), strict=True))
    return {"tokens": n, **summary(timed, p90=("insert", "match"))}


def time_insert_after_match(
    pool: MemPool, traffic: Traffic, system: list[int], n: int, reps: int
) -> list[int]:
    """The prefix-caching engine's path: match, allocate only the uncached pages, insert all
    (blocks the index holds already, which MemPool re-checks)."""
    prefix = shared_prefix(system, n)
    samples: list[int] = []
    for _ in range(reps):
        tokens = traffic.prompt(prefix, n)
        hit = pool.match(tokens)
        addrs = hit.addrs + pool.alloc_blocks(blocks_for(pool, n) - len(hit.addrs))
        t0 = time.perf_counter_ns()
        pool.insert(tokens, addrs)
        samples.append(time.perf_counter_ns() - t0)
        pool.delete(tokens)
    return samples


def time_tree(reps: int) -> dict[str, float]:
    """The index tree alone on the pool's traffic: insert (then delete) a fresh 4K prompt and
    match a cached one, ids as a Python list (an engine's) and as array('I') (the router's)."""
    traffic = Traffic(SEED)
    system = traffic.tokens(SYSTEM_TOKENS)
    tree = RadixTree(PAGE, slots_per_page=1)
    addr = fill_tree(tree, traffic, [system], PRELOAD_TOKENS)
    n = PROMPT_TOKENS
    prefix = shared_prefix(system, n)
    cached = traffic.prompt(prefix, n)
    tree.insert(cached, range(addr, addr + n // PAGE))
    cached_array = array("I", cached)
    rows = []
    for _ in range(reps):
        tokens = traffic.prompt(prefix, n)
        addrs = list(range(addr, addr + n // PAGE))
        as_array, addrs_array = array("I", tokens), array("Q", addrs)
        t0 = time.perf_counter_ns()
        tree.insert(tokens, addrs)
        t1 = time.perf_counter_ns()
        tree.delete(as_array)
        t2 = time.perf_counter_ns()
        tree.insert(as_array, addrs_array)
        t3 = time.perf_counter_ns()
        tree.delete(as_array)
        t4 = time.perf_counter_ns()
        tree.match(cached)
        t5 = time.perf_counter_ns()
        tree.match(cached_array)
        t6 = time.perf_counter_ns()
        rows.append((t1 - t0, t3 - t2, t2 - t1, t5 - t4, t6 - t5))
    names = ("insert_4k", "insert_4k_array", "delete_4k", "match_4k", "match_4k_array")
    timed = {f"tree_{name}": ns for name, ns in zip(names, columns(rows), strict=True)}
    return summary(timed, p90=("tree_insert_4k", "tree_match_4k"))


# --------------------------------------------------------------------------- layouts


def layout_figures() -> dict[str, Any]:
    """Transfer calls for one 4K-token Llama-2-13B request in each layout (plain-int addresses)."""
    spec = LLAMA2_13B
    pages = PROMPT_TOKENS // spec.page_size
    discrete, aggregated = (
        transfer_segments(spec, layout, range(pages * spec.blocks_per_page(layout)))
        for layout in (Layout.DISCRETE, Layout.AGGREGATED)
    )
    discrete_bytes = sum(size for _, size in discrete)
    return {
        "aggregate_calls_ratio": len(discrete) / len(aggregated),
        "layers": spec.layers,
        "discrete_calls_4k": len(discrete),
        "aggregated_calls_4k": len(aggregated),
        "request_bytes_4k": discrete_bytes,
        "transfer_bytes_equal": discrete_bytes == sum(size for _, size in aggregated),
        "layout_roundtrip_exact": layout_roundtrip_exact(),
    }


def layout_roundtrip_exact() -> bool:
    """Real pools in both layouts: aggregated -> discrete blocks -> aggregated keeps every byte."""
    spec = KVBlockSpec(layers=3, kv_heads=2, head_dim=4, dtype="bfloat16", page_size=4)
    agg = MemPool(0, spec, host_blocks=2, layout=Layout.AGGREGATED, huge_pages="off")
    disc = MemPool(
        1, spec, host_blocks=spec.segments_per_page, layout=Layout.DISCRETE, huge_pages="off"
    )
    try:
        return _roundtrip(spec, agg, disc)
    finally:  # the views made in _roundtrip are gone by now; live ones would pin the arenas
        agg.close()
        disc.close()


def _roundtrip(spec: KVBlockSpec, agg: MemPool, disc: MemPool) -> bool:
    payload = random.Random(SEED).randbytes(spec.page_bytes)
    src, dst = agg.alloc_blocks(2)
    agg.write_block(src, payload)
    blocks = disc.alloc_blocks(spec.segments_per_page)
    for addr, segment in zip(blocks, disaggregate(spec, agg.view_block(src)), strict=True):
        disc.write_block(addr, segment)
    aggregate(spec, [disc.view_block(b) for b in blocks], out=agg.view_block(dst))
    seg = spec.segment_bytes
    return agg.read_block(dst) == payload and all(
        disc.read_block(b) == payload[i * seg : (i + 1) * seg] for i, b in enumerate(blocks)
    )


# --------------------------------------------------------------------------- memory and scale


def rss_bytes() -> int:
    return round((rss_mib(os.getpid()) or 0.0) * 2**20)


def fresh_processes(workers: int) -> ProcessPoolExecutor:
    """Freshly spawned interpreters, one task each: no earlier heap in what they measure."""
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=spawn, max_tasks_per_child=1)


def tiny_pool(tokens: int) -> MemPool:
    """A pool of 64-byte blocks with room for an index of `tokens`: its arena stays small."""
    return MemPool(0, TINY_SPEC, host_blocks=tokens // PAGE + 16384, huge_pages="off")


def index_memory(tokens: int, trace: bool, seed: int) -> dict[str, Any]:
    """Build an index of >= `tokens` cached tokens in this (fresh) process; report its growth:
    the index plus the pool's block sets (the arena is mapped before and never touched). With
    `trace`, tracemalloc runs during the build (slower) and attributes bytes per file."""
    pool = tiny_pool(tokens)
    traffic = Traffic(seed)
    systems = traffic.systems()
    gc.collect()
    if trace:
        tracemalloc.start()
    rss_before = rss_bytes()
    conversations, build_s = fill_index(pool, traffic, systems, tokens)
    gc.collect()
    grown = rss_bytes() - rss_before
    result: dict[str, Any] = {
        "tokens": cached_tokens(pool),
        "conversations": conversations,
        "nodes": sum(1 for _ in pool.index.nodes()),
        "build_s": build_s,
        "rss_bytes": grown,
    }
    if trace:
        result["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        package = Path(mempool.__file__).parent
        by_file: dict[str, int] = {}
        for stat in tracemalloc.take_snapshot().statistics("filename"):
            source = Path(stat.traceback[0].filename)
            key = f"mempool/{source.name}" if source.parent == package else "other"
            by_file[key] = by_file.get(key, 0) + stat.size
        tracemalloc.stop()
        result["traced_by_file"] = by_file
    pool.close()
    return result


def measure_index_memory(tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RSS and the tracemalloc pass, side by side, each in its own fresh interpreter."""
    with fresh_processes(2) as pool:
        rss = pool.submit(index_memory, tokens, False, SEED)
        traced = pool.submit(index_memory, tokens, True, SEED)
        return rss.result(), traced.result()


def memory_figures(rss: dict[str, Any], traced: dict[str, Any]) -> dict[str, Any]:
    def per_mtok(nbytes: float, run: dict[str, Any]) -> float:
        return nbytes / 2**20 / (run["tokens"] / 1e6)

    return {
        "index_rss_mib_per_million_tokens": per_mtok(rss["rss_bytes"], rss),
        "index_tracemalloc_mib_per_million_tokens": per_mtok(traced["traced_bytes"], traced),
        "index_tracemalloc_by_file_mib_per_million_tokens": {
            name: per_mtok(size, traced) for name, size in sorted(traced["traced_by_file"].items())
        },
        "memory_tokens_measured": float(rss["tokens"]),
        "memory_tree_nodes": rss["nodes"],
        "memory_conversations": rss["conversations"],
        "memory_build_s": rss["build_s"],
        "memory_build_traced_s": traced["build_s"],
    }


def size_label(tokens: int) -> str:
    """1m, 10m, 200k: the suffix of the per-size figure names."""
    return f"{tokens // 1_000_000}m" if tokens % 1_000_000 == 0 else f"{tokens // 1000}k"


def scale_point(tokens: int, evict_reps: int, expire_reps: int, seed: int) -> dict[str, Any]:
    """evict(16) on a MemPool caching `tokens`, then expiry on a holders tree of that size, in
    a fresh process (its build time and RSS are this size's alone). An evict removes the least
    recently used leaf whole (more than 16 blocks); an expire drops the next-oldest 1% of the
    tree's (node, holder) entries."""
    gc.collect()
    rss_before = rss_bytes()
    pool = tiny_pool(tokens)
    traffic = Traffic(seed)
    conversations, build_s = fill_index(pool, traffic, traffic.systems(), tokens)
    gc.collect()
    rss_index = rss_bytes() - rss_before
    cached = cached_tokens(pool)
    nodes = sum(1 for _ in pool.index.nodes())
    evict_ns: list[int] = []
    freed: list[int] = []
    for _ in range(evict_reps):
        t0 = time.perf_counter_ns()
        blocks = pool.evict(EVICT_BLOCKS)
        evict_ns.append(time.perf_counter_ns() - t0)
        freed.append(len(blocks))
    cached_after = cached_tokens(pool)
    index_bytes_per_page = pool.index._memory_bytes / pool.index.num_pages
    # the index alone: evict 16 blocks' pages from the pool's tree, values dropped (the pool
    # is closed right after, its block sets no longer matter)
    pages = -(-EVICT_BLOCKS // pool.blocks_per_page)
    tree_evict_ns: list[int] = []
    for _ in range(evict_reps):
        t0 = time.perf_counter_ns()
        pool.index.evict(pages)
        tree_evict_ns.append(time.perf_counter_ns() - t0)
    pool.close()
    del pool
    gc.collect()

    now = [0.0]  # the holders tree's clock: one tick per insert, so expiry is reproducible
    tree = RadixTree(PAGE, slots_per_page=0, clock=lambda: now[0])
    traffic = Traffic(seed)
    systems = traffic.systems()
    started = time.perf_counter()
    while tree.num_pages * PAGE < tokens:
        for prompt in traffic.conversation(traffic.rng.choice(systems)):
            now[0] += 1.0
            tree.insert(prompt, holder=traffic.rng.choice(HOLDERS))
    tree_build_s = time.perf_counter() - started
    tree_pages = tree.num_pages
    # Cutoffs at quantiles of the confirmation times (untimed): expire drops seen < cutoff.
    seen = sorted(t for n in tree.nodes() if n.holders for t in n.holders.values())
    stride = max(1, int(len(seen) * STALE_STEP))
    cutoffs = [seen[min(i * stride, len(seen) - 1)] for i in range(1, expire_reps + 1)]
    expire_ns: list[int] = []
    pruned: list[int] = []
    for cutoff in cutoffs:
        t0 = time.perf_counter_ns()
        pruned.append(tree.expire(cutoff))
        expire_ns.append(time.perf_counter_ns() - t0)
    expired = bisect.bisect_left(seen, cutoffs[-1])  # entries older than the last cutoff
    holders_bytes_per_page = tree._memory_bytes / tree.num_pages
    del tree
    gc.collect()
    return {
        "tokens": cached,
        "conversations": conversations,
        "nodes": nodes,
        "build_s": build_s,
        "rss_index_mib": rss_index / 2**20,
        "evict_16_us": median_us(evict_ns),
        "evict_16_p90_us": percentile_us(evict_ns, 0.9),
        "evict_16_max_us": max(evict_ns) / 1e3,
        "evict_reps": evict_reps,
        "evict_freed_blocks_median": statistics.median(freed),
        "tokens_after_evictions": cached_after,
        "holder_tree_pages": tree_pages,
        "holder_tree_build_s": tree_build_s,
        "expire_us": median_us(expire_ns),
        "expire_max_us": max(expire_ns) / 1e3,
        "expire_reps": expire_reps,
        "expire_pruned_pages_median": statistics.median(pruned),
        "expire_pruned_fraction": sum(pruned) / tree_pages,
        "holder_entries": len(seen),
        "expired_entries_fraction": expired / len(seen),
        "tree_evict_16_us": median_us(tree_evict_ns),
        "tree_evict_16_p90_us": percentile_us(tree_evict_ns, 0.9),
        "index_bytes_per_page": index_bytes_per_page,
        "holders_tree_bytes_per_page": holders_bytes_per_page,
        **tree_memory(tokens, seed),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
    }


def tree_memory(tokens: int, seed: int) -> dict[str, Any]:
    """Bytes per cached page of the index tree alone (one address per page), native (what its
    structures hold) and the Python tree it replaced (tracemalloc), from the same inserts."""
    systems = Traffic(seed).systems()
    tree = RadixTree(PAGE, slots_per_page=1)
    fill_tree(tree, Traffic(seed + 1), systems, tokens)
    out: dict[str, Any] = {
        "tree_pages": tree.num_pages,
        "tree_nodes": tree._live_nodes - 1,
        "tree_bytes_per_page": tree._memory_bytes / tree.num_pages,
    }
    del tree
    try:
        from tests.mempool.radix_model import RadixTree as PythonTree
    except ImportError:  # an installed copy without the repository's tests
        return out
    gc.collect()
    tracemalloc.start()
    model = PythonTree(PAGE, slots_per_page=1)
    fill_tree(model, Traffic(seed + 1), systems, tokens)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    out["python_tree_bytes_per_page"] = traced / model.num_pages
    return out


def measure_scale(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """One fresh process per size, one after the other (the timings share no core)."""
    task = progress.add_task(
        f"evict/expire at {', '.join(map(size_label, settings.scale_tokens))} tokens",
        total=len(settings.scale_tokens),
    )
    points = []
    for tokens in settings.scale_tokens:
        with fresh_processes(1) as pool:
            job = pool.submit(scale_point, tokens, settings.evict_reps, settings.expire_reps, SEED)
            points.append({"size": size_label(tokens), **job.result()})
        step(progress, task)
    return points


def scale_figures(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-size headline figures, named by size (evict_16_us_1m, ...), and every point."""
    figures: dict[str, Any] = {"scale": list(points)}
    for p in points:
        build_s = p["build_s"] + p["holder_tree_build_s"]
        values = {**p, "scale_build_s": build_s, "scale_peak_rss_mib": p["peak_rss_mib"]}
        figures.update({f"{k}_{p['size']}": values[k] for k, _ in PER_SIZE if k in values})
    return figures


# --------------------------------------------------------------------------- report


def targets_and_ratios(fig: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """Our targets with whether each is met, and MemServe's published figures beside them."""
    bounds = {
        "alloc_ns_per_block": ("<=", TARGET_ALLOC_NS_PER_BLOCK),
        "insert_4k_us": ("<=", TARGET_INSERT_4K_US),
        "match_4k_us": ("<=", TARGET_MATCH_4K_US),
        "index_rss_mib_per_million_tokens": ("<", TARGET_INDEX_MIB_PER_MTOK),
        "aggregate_calls_ratio": ("==", 2.0 * fig["layers"]),
        "tree_insert_4k_us": ("<=", TARGET_TREE_INSERT_4K_US),
        "tree_match_4k_us": ("<=", TARGET_TREE_MATCH_4K_US),
    }
    for p in fig["scale"]:
        bounds[f"evict_16_us_{p['size']}"] = ("<", TARGET_EVICT_16_US)
        bounds[f"tree_evict_16_us_{p['size']}"] = ("<=", TARGET_TREE_EVICT_16_US)
    targets: dict[str, Any] = {k: check(fig[k], op, limit) for k, (op, limit) in bounds.items()}
    targets["memserve_published"] = {
        "alloc_ns_per_block": MEMSERVE_ALLOC_NS_PER_BLOCK,
        "insert_4k_us_max": MEMSERVE_INSERT_4K_US,
        "source": "MemServe (arXiv 2406.17565), figure 9",
    }
    ratios = {
        "alloc": fig["alloc_ns_per_block"] / MEMSERVE_ALLOC_NS_PER_BLOCK,
        "insert": fig["insert_4k_us"] / MEMSERVE_INSERT_4K_US,
    }
    return targets, ratios


def table_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per headline figure: name, value, unit, target, met."""
    rows = list(HEADLINE)
    for p in fig["scale"]:
        tokens = f"{p['tokens'] / 1e6:.1f}M tokens"
        rows += [(f"{k}_{p['size']}", unit.format(t=tokens)) for k, unit in PER_SIZE]
    out = []
    for name, unit in rows:
        if name not in fig:  # the Python tree's bytes, without the repository's tests
            continue
        target = fig["targets"].get(name)
        bound = f"{target['op']} {target['limit']:g}" if target else None
        met = target["met"] if target else None
        out.append({"name": name, "value": fig[name], "unit": unit, "target": bound, "met": met})
    for name, published in (("alloc", "800 ns/block"), ("insert", "700 µs")):
        value = fig["memserve_ratio"][name]
        unit = f"ours / MemServe ({published})"
        out.append({"name": f"memserve_ratio.{name}", "value": value, "unit": unit})
    return out


def plot(path: Path, fig: dict[str, Any]) -> None:
    """Latency curves in the manner of MemServe's figure 9, with its figures and our targets;
    then eviction and expiry against the size of the index."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    figure, (left, right, third) = plt.subplots(1, 3, figsize=(16, 4.4), constrained_layout=True)
    alloc, index, scale = fig["alloc_curve"], fig["index_curve"], fig["scale"]
    blocks = [p["blocks"] for p in alloc]
    left.plot(blocks, [p["alloc_us"] for p in alloc], "o-", label="alloc_blocks")
    left.plot(blocks, [p["free_us"] for p in alloc], "s-", label="free_mem")
    for ns, style, label in (
        (MEMSERVE_ALLOC_NS_PER_BLOCK, "k--", "MemServe, ~800 ns/block"),
        (TARGET_ALLOC_NS_PER_BLOCK, "k:", "alloc target, 100 ns/block"),
    ):
        left.plot(blocks, [b * ns / 1e3 for b in blocks], style, lw=0.8, label=label)
    left.set(xlabel="blocks per call", title="(a) block allocation")

    tokens = [p["tokens"] for p in index]
    right.plot(tokens, [p["insert_us"] for p in index], "o-", label="insert")
    right.plot(tokens, [p["match_us"] for p in index], "s-", label="match (full hit)")
    right.plot(tokens, [p["match_partial_us"] for p in index], "^-", label="match (half hit)")
    right.plot([PROMPT_TOKENS], [MEMSERVE_INSERT_4K_US], "kx", ms=9, label="MemServe insert 4K")
    for target, colour, what in (
        (TARGET_INSERT_4K_US, "C0", "insert"),
        (TARGET_MATCH_4K_US, "C1", "match"),
    ):
        label = f"{what} target 4K"
        right.plot([PROMPT_TOKENS], [target], "D", color=colour, mfc="none", ms=9, label=label)
    right.set(xlabel="prompt length (tokens)", title=f"(b) index, {PRELOAD_TOKENS:,} tokens cached")
    for axes, ticks in ((left, blocks), (right, tokens)):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks)
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.xaxis.set_minor_formatter(NullFormatter())

    sizes = [p["tokens"] for p in scale]
    third.plot(sizes, [p["evict_16_us"] for p in scale], "o-", label="MemPool.evict(16)")
    third.plot(sizes, [p["evict_16_p90_us"] for p in scale], "o:", label="evict(16), p90")
    third.plot(sizes, [p["expire_us"] for p in scale], "s-", label="expire 1% (holders tree)")
    third.axhline(TARGET_EVICT_16_US, color="k", ls=":", lw=0.8, label="evict target, 20 µs")
    third.set(xlabel="cached tokens", title="(c) eviction and expiry at scale", xscale="log")
    third.set_xlim(min(sizes) / 2, max(sizes) * 2)
    for axes in (left, right, third):
        axes.set_yscale("log")
        axes.set_ylabel("latency per call (µs)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle("MemPool micro-benchmarks (cf. MemServe figure 9); medians")
    save(figure, path, dpi=120)


# --------------------------------------------------------------------------- driver


def bench_alloc(settings: Settings, progress: Progress) -> dict[str, Any]:
    task = progress.add_task("alloc/free (8..1024 blocks)", total=len(ALLOC_SWEEP) + 1)
    pool = MemPool(0, BENCH_SPEC, host_blocks=POOL_BLOCKS)
    try:
        curve = []
        for blocks in ALLOC_SWEEP:
            curve.append(time_alloc_free(pool, blocks, settings))
            step(progress, task)
        alloc_ns, free_ns = time_single_calls(pool, ALLOC_BLOCKS, settings.single_reps)
        step(progress, task)
        backing = pool.stats()["tiers"]["host"]["backing"]
    finally:
        pool.close()
    head = next(p for p in curve if p["blocks"] == ALLOC_BLOCKS)
    return {
        "alloc_ns_per_block": head["alloc_us"] * 1e3 / ALLOC_BLOCKS,
        "free_ns_per_block": head["free_us"] * 1e3 / ALLOC_BLOCKS,
        "alloc_p50_us": median_us(alloc_ns),
        "free_p50_us": median_us(free_ns),
        "alloc_p99_us": percentile_us(alloc_ns, 0.99),
        "free_p99_us": percentile_us(free_ns, 0.99),
        "alloc_blocks_per_call": ALLOC_BLOCKS,
        "alloc_arena_backing": backing,
        "alloc_curve": curve,
    }


def bench_index(settings: Settings, progress: Progress) -> dict[str, Any]:
    preload = progress.add_task(f"preload {PRELOAD_TOKENS:,} tokens", total=1)
    sweep = progress.add_task("insert/match (256..16384 tokens)", total=len(PROMPT_SWEEP) + 1)
    pool = MemPool(0, BENCH_SPEC, host_blocks=POOL_BLOCKS)
    traffic = Traffic(SEED)
    try:
        system = traffic.tokens(SYSTEM_TOKENS)
        conversations, _ = fill_index(pool, traffic, [system], PRELOAD_TOKENS)
        preloaded = cached_tokens(pool)
        step(progress, preload)
        reps = settings.index_reps
        curve = []
        for n in PROMPT_SWEEP:
            curve.append(index_point(pool, traffic, system, n, reps))
            step(progress, sweep)
        after_match_ns = time_insert_after_match(pool, traffic, system, PROMPT_TOKENS, reps)
        step(progress, sweep)
        restored = cached_tokens(pool) == preloaded
    finally:
        pool.close()
    head = next(p for p in curve if p["tokens"] == PROMPT_TOKENS)
    return {
        "insert_4k_us": head["insert_us"],
        "match_4k_us": head["match_us"],
        "match_4k_partial_us": head["match_partial_us"],
        "delete_4k_us": head["delete_us"],
        "insert_4k_p90_us": head["insert_p90_us"],
        "match_4k_p90_us": head["match_p90_us"],
        "insert_4k_after_match_us": median_us(after_match_ns),
        "index_reps": reps,
        "preload_cached_tokens": preloaded,
        "preload_conversations": conversations,
        "index_size_restored": restored,
        "index_curve": curve,
    }


def once(progress: Progress, label: str, measure: Callable[..., T], *args: Any) -> T:
    """`measure(*args)` as one step of the progress bar."""
    task = progress.add_task(label, total=1)
    result = measure(*args)
    step(progress, task)
    return result


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """Every measurement, then the JSON, Markdown and PNG files; returns the figures."""
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    calibration = [calibration_us()]
    with progress_bar(34) as progress:
        alloc = bench_alloc(settings, progress)
        calibration.append(calibration_us())
        index = bench_index(settings, progress)
        tree = once(
            progress, "the index tree alone (4K insert/match)", time_tree, settings.index_reps
        )
        calibration.append(calibration_us())
        layout = once(progress, "layouts (Llama-2-13B, round trip)", layout_figures)
        memory = f"index memory ({settings.memory_tokens:,} tokens)"
        rss, traced = once(progress, memory, measure_index_memory, settings.memory_tokens)
        scale = measure_scale(settings, progress)

    figures: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "seed": SEED,
        "mempool_sources_sha256": mempool_sources_digest(),
        "calibration_array4k_us": calibration,
        **alloc,
        **index,
        **tree,
        **layout,
        **memory_figures(rss, traced),
        **scale_figures(scale),
        "config": {
            "bench_spec": asdict(BENCH_SPEC),
            "bench_block_bytes": BENCH_SPEC.block_size(Layout.AGGREGATED),
            "memory_spec": asdict(TINY_SPEC),
            "model_spec": asdict(LLAMA2_13B),
            "pool_blocks": POOL_BLOCKS,
            "vocab": VOCAB,
            "settings": asdict(settings),
        },
    }
    figures["targets"], figures["memserve_ratio"] = targets_and_ratios(figures)
    figures["elapsed_s"] = time.perf_counter() - started
    title = "MemPool micro-benchmarks"
    write_results(out_dir, NAME, figures, table_rows(figures), title, notes(figures, settings))
    plot(out_dir / f"{NAME}.png", figures)
    return figures


def mempool_sources_digest() -> str:
    """Hash of the measured mempool sources: names the code even when the tree is dirty."""
    digest = hashlib.sha256()
    for source in sorted(Path(mempool.__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def notes(fig: dict[str, Any], settings: Settings) -> list[str]:
    """How each figure was taken, so a reader can judge it without reading the code."""
    measured = int(fig["memory_tokens_measured"])
    calibration = ", ".join(f"{c:.1f}" for c in fig["calibration_array4k_us"])
    out = [
        f"Mode: {fig['mode']}; elapsed {fig['elapsed_s']:.1f} s. Medians, the garbage "
        "collector on (as in an engine); targets reported, not asserted.",
        f"alloc/free: alloc_blocks({ALLOC_BLOCKS}) and free_mem of its result, median of "
        f"{settings.alloc_batches} batches of {settings.alloc_calls} calls / {ALLOC_BLOCKS}; "
        f"p50/p99 from {settings.single_reps} single calls; "
        f"{BENCH_SPEC.block_size(Layout.AGGREGATED)} B blocks, {POOL_BLOCKS:,}-block pool.",
        f"Index: {fig['preload_cached_tokens']:,} tokens cached beforehand "
        f"({fig['preload_conversations']} chats after one {SYSTEM_TOKENS}-token system "
        f"prompt, seed {SEED}); each insert a fresh prompt (a list) whose first quarter is "
        "the system prompt, allocated and deleted untimed; match_4k_partial hits the first "
        f"half; insert_4k_after_match inserts after a match (only the insert timed); "
        f"{settings.index_reps} repetitions a point.",
        f"aggregate_calls_ratio: transfer_segments calls for a {PROMPT_TOKENS}-token "
        f"Llama-2-13B request, discrete / aggregated: {fig['discrete_calls_4k']} / "
        f"{fig['aggregated_calls_4k']} (L={fig['layers']}).",
        f"Index memory: {measured:,} cached tokens ({fig['memory_conversations']} chats over "
        f"{MEMORY_SYSTEM_PROMPTS} system prompts, {fig['memory_tree_nodes']} nodes) built in a "
        "fresh process: growth of VmRSS (and, in another process, tracemalloc's traced bytes), "
        "the pool's block sets included, the arena untouched.",
        "tree_*: the bare native RadixTree (one address per page) on the same traffic, ids as a "
        "list and as array('I'); bytes per page: its structures, beside tracemalloc's figure "
        "for the Python tree it replaced.",
        f"At scale, each size in its own process: MemPool.evict({EVICT_BLOCKS}) call by call "
        "(a call removes the least recently used leaf whole); then a holders tree "
        f"({len(HOLDERS)} instances, a clock ticking per insert) where each expire drops the "
        f"next-oldest {STALE_STEP:.0%} of its entries.",
    ]
    out += [
        f"{p['size']}: {p['tokens']:,} tokens, {p['nodes']:,} nodes, built in "
        f"{p['build_s']:.1f} s (+{p['rss_index_mib']:.0f} MiB); evict median "
        f"{p['evict_16_us']:.1f} µs, p90 {p['evict_16_p90_us']:.1f}, max "
        f"{p['evict_16_max_us']:.0f} ({p['evict_reps']} calls, "
        f"{p['evict_freed_blocks_median']:g} blocks each); holders tree "
        f"{p['holder_tree_pages']:,} pages in {p['holder_tree_build_s']:.1f} s, expire median "
        f"{p['expire_us']:.1f} µs ({p['expire_reps']} calls, "
        f"{p['expire_pruned_pages_median']:g} pages each, {p['expired_entries_fraction']:.1%} "
        f"of {p['holder_entries']:,} entries); peak RSS {p['peak_rss_mib']:.0f} MiB."
        for p in fig["scale"]
    ]
    out.append(f"calibration_array4k_us (a fixed C workload, before/between/after): {calibration}.")
    if not fig["index_size_restored"]:
        out.append("WARNING: the preloaded index did not return to its size after the sweep.")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    quick = "fewer repetitions, 200k-token memory"
    return benchmark_main(argv, NAME, __doc__, run, quick, summary_end="\n## ")


if __name__ == "__main__":
    sys.exit(main())
