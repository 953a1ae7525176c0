"""What a router adds on top of its workers: ours (`python -m router`) and sglang-router.

`python -m benchmarks router-overhead`: added latency and max requests/s over two sim workers
that answer in about a millisecond, and in process our policy's decision time and the
tokenizer's cost. docs/benchmarks/router-overhead.md has the method and the figures.

Modules: `settings` (sizes, workloads, targets), `text` (the chats), `systems` (the
processes), `phases` (the HTTP measurements, through `benchmarks.load`), `in_process`
(tokenizer and decision time), `figures` and `targets` (from samples to results), `report`
and `plots` (the files), `__main__` (the run).
"""
