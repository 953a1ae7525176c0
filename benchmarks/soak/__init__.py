"""Soak: a local cluster under steady open-loop load for minutes; does anything leak or fail?

`python -m benchmarks soak [--pd]`; what it runs and why: `docs/benchmarks/soak.md`. Modules:
`load` (the sessions and their load), `cluster` (the processes, their RSS and gauges, the
MemPool check), `analysis` (records and samples to figures), `report` (the files and plots).
"""
