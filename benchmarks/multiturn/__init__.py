"""Multi-turn cache benchmarks: routing policies, peer routers and PD caching modes, one run.

`python -m benchmarks.multiturn --out DIR [--quick]` starts sim workers (the latency model of
Llama-3.1-8B on an H100, `--time-scale 1`), and in front of the very same workers, one after
another with caches flushed in between: every policy of our router, sglang-router
(`cache_aware`, `round_robin`) and smg (its successor gateway). A peer that cannot run is
recorded with the reason. Clusters: 4 colocated instances with and without caching, and, at
equal instance counts, 2 colocated (with and without caching) against 1P1D in each PD caching
mode (MemServe's PD, PD-CC, 1P1D, 1P1D-CC).

Workloads (module `workloads`, `trace`): a replay of Mooncake's conversation trace (or any
trace in its format, `--trace FILE`), production-stack's multi-round QA, ShareGPT-like chat,
LooGLE-like document QA (with MemServe's share ratio), ReAct-like agent loops. Poisson
arrivals; sessions are causal (a turn goes after the previous answer and carries it).

`--capacity` (module `capacity`) is the capacity-bound preset: the workers' device KV
sized so the working set is 2x, 4x and 8x the cluster's, with and without a host tier, every
system on the same workers over paired seeds, against the oracle and the TTFT floor.

`--sweep` (modules `sweep_preset`, `sweep_report`) is the robustness sweep of issue 37: ours
`prompt_tree` and `cost` against sglang-router cache_aware and round_robin, one factor at a
time around a base hot-prefix cell (Zipf exponent, prefix count and length, text prompts or
chats, load, engine speed per worker), paired seeds; it writes DIR/README.md (the sweep's
table and its heat map of ours' TTFT ratios to cache_aware) instead of results.md.

Writes DIR/results.json (one object per run, the targets, the sim's parameters),
DIR/results.md and PNG plots. Targets are reported, never asserted.
"""
