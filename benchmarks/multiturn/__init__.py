"""Multi-turn cache benchmarks: routing policies, peer routers and PD caching modes, one run.

`python -m benchmarks multiturn` (and its presets `capacity`, `hot-prefix`, `pd`, `sweep`):
every system in front of the very same sim workers, caches flushed in between, on the
workloads of `workloads` and `trace`. What each preset measures and its current figures are
on the docs' benchmark pages (docs/benchmarks/). Targets are reported, never asserted.
"""
