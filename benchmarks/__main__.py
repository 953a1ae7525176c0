"""`python -m benchmarks SUITE [--quick] [FLAGS]`: every benchmark under one command.

A suite is a module of this package, or one of the multi-turn module's presets; its current
results live in `benchmarks/results/<folder>/`, which a run overwrites unless `--out` says
otherwise. `python -m benchmarks` alone lists the suites. The flags after the suite's name are
the suite's own (`python -m benchmarks SUITE --help` lists them); the module names still work
(`python -m benchmarks.overload ...`), with the same flags.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    """One benchmark: the module that runs it, the flags that pick it within that module and
    the results folder a full run rewrites."""

    module: str
    measures: str
    folder: str
    preset: tuple[str, ...] = ()


SUITES = {
    "multiturn": Suite("multiturn", "every policy vs the peers on multi-turn chat", "multiturn"),
    "capacity": Suite(
        "multiturn",
        "caches 2x-8x smaller than the working set",
        "multiturn_capacity",
        ("--capacity",),
    ),
    "hot-prefix": Suite(
        "multiturn",
        "Zipf-popular shared prefixes near saturation",
        "multiturn_hot_prefix",
        ("--hot-prefix",),
    ),
    "pd": Suite("multiturn", "PD with several prefills", "multiturn_pd", ("--pd",)),
    "sweep": Suite(
        "multiturn",
        "one factor at a time around a hot-prefix cell",
        "multiturn_sweep",
        ("--sweep",),
    ),
    "lora": Suite(
        "multiturn",
        "20 LoRA adapters of Zipf popularity on 4 workers holding 4 each",
        "multiturn_lora",
        ("--lora",),
    ),
    "tenants": Suite(
        "multiturn",
        "4 tenants sharing a public tool prompt: isolation's cost, fairness",
        "multiturn_tenants",
        ("--tenants",),
    ),
    "overload": Suite("overload", "goodput from 50% to 150% of the sustained rate", "overload"),
    "router-overhead": Suite(
        "router_overhead", "decision time, added latency, max requests/s", "router_overhead"
    ),
    "text-routing": Suite("text_routing", "text prompts in any script", "text_routing"),
    "reliability": Suite("reliability", "faults, bad inputs, HTTP attacks", "reliability"),
    "soak": Suite("soak", "memory and latency over minutes of steady load", "soak"),
    "mempool": Suite("mempool_micro", "MemPool's alloc, index and eviction", "mempool_micro"),
    "transfer": Suite("transfer", "one request's KV between two MemPools", "transfer"),
    "hicache": Suite("hicache_micro", "SGLang's L3 storage paths", "hicache_micro"),
}


def usage() -> str:
    width = max(map(len, SUITES))
    rows = [
        f"  {name:<{width}}  {suite.measures} -> benchmarks/results/{suite.folder}/"
        for name, suite in SUITES.items()
    ]
    return "usage: python -m benchmarks SUITE [--quick] [FLAGS]\n\nsuites:\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, *rest = args
    suite = SUITES.get(name)
    if suite is None:
        print(f"unknown suite {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if "--out" not in rest and not any(a.startswith("--out=") for a in rest):
        rest = ["--out", f"benchmarks/results/{suite.folder}", *rest]
    module = importlib.import_module(f"benchmarks.{suite.module}")
    if hasattr(module, "__path__"):  # a package: its entry point is its __main__
        module = importlib.import_module(f"benchmarks.{suite.module}.__main__")
    sys.argv = [f"python -m benchmarks {name}", *suite.preset, *rest]
    return int(module.main([*suite.preset, *rest]) or 0)


if __name__ == "__main__":
    sys.exit(main())
