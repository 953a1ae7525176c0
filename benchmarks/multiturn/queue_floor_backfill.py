"""Add the queued floor to hot-prefix runs recorded before the runner computed it.

`python -m benchmarks.multiturn.queue_floor_backfill DIR` rebuilds each run's synthetic
workload from its recorded seed, size and rate, replays it into the oracle, queues it at
its planned send times (the client sends open-loop, on those times) and writes
`queue_floor_ttft_mean_s` / `_p99_s` into DIR/results.json; `--report-only` then rewrites
the page. Runs of other workloads (closed-loop sessions send when the answers come, so only
the run itself knows its send times) are left as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.queue_floor import prefill_servers, queued_floor_stats
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.working_set import estimate
from connector.worker.latency_model import LatencyModel


def backfill(runs: list[dict[str, Any]], vocab: Vocab, encoder: Any) -> int:
    """Fill the queued floor of every hot-prefix run without one; how many were filled."""
    built: dict[tuple[int, int, float], Any] = {}
    filled = 0
    for run in runs:
        if run.get("workload") != "hot_prefix" or "queue_floor_ttft_p99_s" in run:
            continue
        params = run["workload_params"]
        builder = HotPrefix(**{k: params[k] for k in HotPrefix.__dataclass_fields__ if k in params})
        key = (builder.seed, builder.requests, builder.rate)
        if key not in built:
            workload = builder.build(vocab)
            built[key] = (workload, estimate(workload, vocab, encoder))
        workload, planned = built[key]
        model = run["floor_model"]
        floor = Floor(LatencyModel(), int(model["chunked_prefill_size"]), model["time_scale"])
        servers = prefill_servers(run["worker_roles"])
        sent = [r.at_s for r in workload.requests]
        rids = [r.rid for r in workload.requests if not r.warmup]
        run.update(queued_floor_stats(floor, planned.hits, planned.lengths, sent, rids, servers))
        filled += 1
    return filled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a results directory (its results.json)")
    args = parser.parse_args()
    from connector.model_files import ensure_hf_model
    from connector.token_cache import CachedEncoder
    from connector.tokenizer import ChatTokenizer

    path = args.out / "results.json"
    data = json.loads(path.read_text())
    tokenizer = ChatTokenizer(ensure_hf_model())
    filled = backfill(data["runs"], Vocab.from_tokenizer(tokenizer), CachedEncoder(tokenizer))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"{path}: the queued floor added to {filled} runs")


if __name__ == "__main__":
    main()
