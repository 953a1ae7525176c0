"""Soak: a local cluster under steady open-loop load for minutes; does anything leak or fail?

Run: ``python -m benchmarks.soak --minutes N --rps R [--pd] [--out DIR]``. Writes
DIR/results.json, DIR/results.md, DIR/latency.png and DIR/rss.png (default DIR
benchmarks/results/soak).

A few sim workers with a small device KV (``--max-total-tokens``, so caches fill, evict and
churn for the whole run) and our router in front (``--policy prompt-tree``), all on free
loopback ports; with ``--pd`` one prefill and one decode worker instead. A Poisson stream of
``R`` requests/s for ``N`` minutes continues multi-turn sessions whose histories grow (shared
system prompts, a new user message each turn, the answer appended), through
/v1/chat/completions and /generate, streamed or not. A few requests are deliberately bad
(they must get a 400) and a few streams are abandoned after their first chunk (the abort path
must free what the request held): both are expected outcomes; anything else that is not a
complete, well-formed answer is an unexpected error, kept with its status and body.

Every few seconds the RSS (VmRSS) and CPU time of every process (router, each worker, any
child process) and the key gauges (router tree pages and tokenizer cache, workers' pool
blocks, queue and evictions) are sampled. The report: outcomes by kind, latency (TTFT of
streams, end to end of all) p50/p99 per time window, RSS per process at the end of warm-up
and at the end with its least-squares slope after warm-up, the verdict "memory flat after
warm-up" against a stated threshold, and each worker's MemPool accounting (blocks used ==
blocks indexed, none pinned) once the load has stopped.

Modules: `config` (the command line), `workload` (sessions and their prompts), `load` (the
open-loop load, sent through `benchmarks.load`), `sampler` (RSS and gauges), `cluster` (the
processes and the final MemPool check), `analysis` (records to figures), `report` and
`plots` (the files), `__main__` (the run).
"""
