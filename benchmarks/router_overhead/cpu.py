"""CPU time of a router and every process it started, read from /proc: what a request
costs the router itself, which no noise from the client or the workers sharing the
machine can move."""

from __future__ import annotations

from benchmarks.soak.sampler import children
from localrun.cluster import cpu_seconds


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants (0 for a gone process)."""
    return sum(cpu_seconds(p) for p in (pid, *children(pid)))
