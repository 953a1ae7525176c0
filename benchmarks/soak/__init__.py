"""Soak: a local cluster under steady open-loop load for minutes; does anything leak or fail?

`python -m benchmarks soak [--pd]`: multi-turn sessions, deliberately bad and abandoned
requests among them, while every process's RSS and the caches' gauges are sampled; the
verdict is the RSS slope after warm-up and each worker's MemPool accounting once the load
stops. docs/benchmarks/soak.md has the method and the figures.

Modules: `config` (the command line), `workload` (sessions and their prompts), `load` (the
open-loop load, sent through `benchmarks.load`), `sampler` (RSS and gauges), `cluster` (the
processes and the final MemPool check), `analysis` (records to figures), `report` and
`plots` (the files), `__main__` (the run).
"""
