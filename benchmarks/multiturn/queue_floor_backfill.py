"""Add the queued floors to hot-prefix runs recorded before the runner computed them.

`python -m benchmarks.multiturn.queue_floor_backfill DIR` rebuilds each run's synthetic
workload from its recorded seed, size and rate, replays it into the oracle and into the LRU
reference (the run's prefill workers and device KV; none with a host tier), queues it at
its planned send times (the client sends open-loop, on those times) and writes
`queue_floor_ttft_mean_s` / `_p99_s`, `lru_hit_ratio` and `lru_queue_floor_ttft_mean_s` /
`_p99_s` into DIR/results.json, where missing; `--report-only` then rewrites the page.
Runs of other workloads (closed-loop sessions send when the answers come, so only the run
itself knows its send times) are left as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.oracle import LruCaches, replay
from benchmarks.multiturn.queue_floor import lru_reference, prefill_servers, queued_floor_stats
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.working_set import planned_outcomes
from connector.worker.latency_model import LatencyModel


def backfill(runs: list[dict[str, Any]], vocab: Vocab, encoder: Any) -> int:
    """Fill the queued floors of every hot-prefix run missing one; how many were filled."""
    built: dict[tuple[int, int, float], Any] = {}
    filled = 0
    for run in runs:
        capacity = run.get("worker_capacity_tokens") or run.get("instance_kv_tokens")
        lru_wanted = bool(capacity) and not run.get("hicache_ratio")
        lru_wanted = lru_wanted and "lru_queue_floor_ttft_p99_s" not in run
        if run.get("workload") != "hot_prefix" or not (
            lru_wanted or "queue_floor_ttft_p99_s" not in run
        ):
            continue
        builder = HotPrefix.from_params(run["workload_params"])
        key = (builder.seed, builder.requests, builder.rate)
        if key not in built:
            workload = builder.build(vocab)
            built[key] = (workload, planned_outcomes(workload, vocab))
        workload, outcomes = built[key]
        servers = prefill_servers(run["worker_roles"])
        lru = LruCaches(servers, int(capacity or 0)) if lru_wanted else None
        planned = replay(encoder, workload.requests, outcomes, lru)
        model = run["floor_model"]
        floor = Floor(LatencyModel(), int(model["chunked_prefill_size"]), model["time_scale"])
        sent = [r.at_s for r in workload.requests]
        rids = [r.rid for r in workload.requests if not r.warmup]
        lengths = planned.lengths
        if "queue_floor_ttft_p99_s" not in run:
            run.update(queued_floor_stats(floor, planned.hits, lengths, sent, rids, servers))
        if planned.lru_hits is not None:
            run.update(lru_reference(floor, planned.lru_hits, lengths, sent, rids, servers))
        filled += 1
    return filled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a results directory (its results.json)")
    args = parser.parse_args()
    from connector.model_files import ensure_hf_model
    from shared.token_cache import CachedEncoder
    from shared.tokenizer import ChatTokenizer

    path = args.out / "results.json"
    data = json.loads(path.read_text())
    tokenizer = ChatTokenizer(ensure_hf_model())
    filled = backfill(data["runs"], Vocab.from_tokenizer(tokenizer), CachedEncoder(tokenizer))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"{path}: the queued floors added to {filled} runs")


if __name__ == "__main__":
    main()
