"""HiCache L3 micro-benchmark: MemPool's SGLang storage backend against SGLang's file backend.

Both driven by SGLang's own HiCacheController paths (`_page_backup`, `_page_transfer`, verbatim
from the wheel: connector/sglang/cpu_paths.py) on a CPU host pool: ours zero-copy (`interface_v1`,
as docs/sglang/hicache.md configures it) and through the legacy tensor calls, `HiCacheFile` on
local disk; every page compared byte for byte.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

from benchmarks.harness import benchmark_main, progress_bar, step
from benchmarks.report.figures import pyplot, save
from benchmarks.report.page import write_results
from benchmarks.report.seeds import spread
from benchmarks.report.table import table_section
from connector.sglang.backend import MemPoolStorage
from connector.sglang.cpu_paths import (
    Controller,
    HostPool,
    PrefetchOperation,
    StorageOperation,
    storage_config,
)

NAME = "hicache_micro"
FULL = {"pages": 256, "repeats": 7, "page": 64, "layers": 30, "heads": 3, "dim": 64}
QUICK = {"pages": 16, "repeats": 2, "page": 16, "layers": 4, "heads": 2, "dim": 32}
SYSTEMS = ("mempool v1 (zero-copy)", "mempool legacy", "sglang HiCacheFile")
OPS = ("set", "get")


def keys_for(pages: int, round_: int) -> list[str]:
    """Distinct SHA-256 page keys per round (the store is cleared between rounds anyway)."""
    return [hashlib.sha256(f"{round_}:{i}".encode()).hexdigest() for i in range(pages)]


def one_round(
    ctl: Controller, backend: Any, keys: list[str], page: int
) -> tuple[float, float, bool]:
    """Write `keys`' pages from host slots [0, n) and read them into [n, 2n): seconds each,
    and whether every page came back byte for byte."""
    host = ctl.storage_host_pool
    n = len(keys)
    src = torch.arange(0, n * page, dtype=torch.int64)
    dst = torch.arange(n * page, 2 * n * page, dtype=torch.int64)
    backend.clear()
    host.kv_buffer[:, :, n * page :] = 0
    write = StorageOperation(src, [], hash_value=keys)
    t0 = time.perf_counter()
    ctl._page_backup(write)
    t1 = time.perf_counter()
    read = PrefetchOperation("bench", [], None)
    read.hash_value, read.host_indices = keys, dst
    t2 = time.perf_counter()
    got = ctl._page_transfer(read)
    t3 = time.perf_counter()
    ok = (
        write.completed_tokens == n * page
        and got == n
        and torch.equal(host.kv_buffer[:, :, : n * page], host.kv_buffer[:, :, n * page :])
    )
    return t1 - t0, t3 - t2, ok


def run(out: Path, quick: bool) -> dict[str, Any]:
    p = QUICK if quick else FULL
    page, pages = p["page"], p["pages"]
    host = HostPool(2 * pages * page, page, p["layers"], p["heads"], p["dim"], torch.bfloat16)
    host.fill(1)
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    ours = MemPoolStorage(
        storage_config(
            {"interface_v1": 1, "mempool_instance_id": 1, "mempool_capacity_pages": pages}
        )
    )
    ours.register_mem_pool_host(host)
    tmp = tempfile.TemporaryDirectory(prefix="hicache-file-", dir=out if out.exists() else None)
    file_be = HiCacheFile(storage_config({"file_storage_path": tmp.name}))
    file_be.register_mem_pool_host(host)
    ctls = {
        SYSTEMS[0]: (Controller(ours, host, zero_copy=True), ours),
        SYSTEMS[1]: (Controller(ours, host, zero_copy=False), ours),
        SYSTEMS[2]: (Controller(file_be, host, zero_copy=False), file_be),
    }
    samples: dict[str, dict[str, list[float]]] = {s: {op: [] for op in OPS} for s in SYSTEMS}
    all_ok = True
    try:
        with progress_bar() as bar:
            task = bar.add_task("batch_set/batch_get rounds", total=p["repeats"] * len(SYSTEMS))
            for ctl, backend in ctls.values():  # warm-up: memory faulted in, untimed
                all_ok &= one_round(ctl, backend, keys_for(pages, -1), page)[2]
            for r in range(p["repeats"]):
                for system, (ctl, backend) in ctls.items():
                    set_s, get_s, ok = one_round(ctl, backend, keys_for(pages, r), page)
                    all_ok &= ok
                    samples[system]["set"].append(set_s)
                    samples[system]["get"].append(get_s)
                    step(bar, task)
    finally:
        ours.close()
        file_be.clear()
        tmp.cleanup()

    total_bytes = pages * page_bytes
    results: dict[str, Any] = {
        system: {
            op: {
                "seconds": secs,
                "pages_per_s": spread(pages / s for s in secs),
                "gb_per_s": spread(total_bytes / s / 1e9 for s in secs),
            }
            for op, secs in samples[system].items()
        }
        for system in SYSTEMS
    }
    rows = []
    for system in SYSTEMS:
        for op, entry in results[system].items():
            pps, gbs = entry["pages_per_s"], entry["gb_per_s"]
            rows.append(
                {
                    "backend": system,
                    "call": f"batch_{op}",
                    "pages/s (median)": round(pps["median"]),
                    "pages/s [min..max]": f"{pps['min']:.0f}..{pps['max']:.0f}",
                    "GB/s (median)": round(gbs["median"], 2),
                    "GB/s [min..max]": f"{gbs['min']:.2f}..{gbs['max']:.2f}",
                }
            )
    v1, theirs = results[SYSTEMS[0]], results[SYSTEMS[2]]
    ratios = {op: v1[op]["gb_per_s"]["median"] / theirs[op]["gb_per_s"]["median"] for op in OPS}
    figures = {
        "mode": "quick" if quick else "full",
        "params": p,
        "page_bytes": page_bytes,
        "bytes_per_round": total_bytes,
        "all_bytes_verified": all_ok,
        "results": results,
        "ours_v1_over_file": ratios,
    }
    notes = [
        f"Each round: {pages} pages of {page_bytes:,} bytes ({total_bytes / 1e6:.0f} MB) written "
        f"into an empty store, then read back; {p['repeats']} rounds, systems interleaved. "
        "Every page read back was compared byte for byte with what was written "
        f"(all equal: {all_ok}).",
        "Both backends run through SGLang's own HiCacheController storage methods; the file "
        "backend writes to local disk and reads through the page cache.",
        f"ours v1 / file, median GB/s: set {ratios['set']:.2f}x, get {ratios['get']:.2f}x.",
    ]
    title = "HiCache L3 micro-benchmark: MemPool backend vs SGLang's file backend"
    body = table_section("Throughput (median and spread over rounds)", rows)
    write_results(out, NAME, figures, None, title, notes, body=body)
    plot(out, results)
    return figures


def plot(out: Path, results: dict[str, Any]) -> None:
    """Median GB/s of each call per backend, bars from the slowest to the fastest round."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.26
    for i, system in enumerate(SYSTEMS):
        g = [results[system][op]["gb_per_s"] for op in OPS]
        meds = [x["median"] for x in g]
        errors = [[x["median"] - x["min"] for x in g], [x["max"] - x["median"] for x in g]]
        xs = [j + (i - 1) * width for j in range(len(OPS))]
        ax.bar(xs, meds, width, yerr=errors, capsize=4, label=system)
    ax.set_xticks([0, 1], ["batch_set (write)", "batch_get (read)"])
    ax.set_ylabel("GB/s (median; bars: min..max)")
    ax.set_title("SGLang HiCache L3 backends, through SGLang's controller paths")
    ax.legend()
    fig.tight_layout()
    save(fig, out / f"{NAME}.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, NAME, __doc__, run, "16 small pages, 2 rounds (seconds)")


if __name__ == "__main__":
    raise SystemExit(main())
