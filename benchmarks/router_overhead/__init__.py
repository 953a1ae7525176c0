"""What a router adds on top of its workers: ours (`python -m router`) and sglang-router.

`python -m benchmarks router-overhead`: added latency and max requests/s over two sim workers
that answer in about a millisecond, and in process our policy's decision time and the
tokenizer's cost. docs/benchmarks/router-overhead.md has the method and the figures.

Modules: `settings` (sizes, targets, the workloads' text), `systems` (the processes),
`phases` (the measurements), `profile` (py-spy at the max rate), `figures` (samples to
results and targets), `report` (the files), `floor_proxy` (the Python floor), `__main__`.
"""
