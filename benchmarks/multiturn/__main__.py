"""`python -m benchmarks.multiturn --out DIR [--quick]`: see the package docstring."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import progress_bar
from benchmarks.multiturn.plan import make_plan
from benchmarks.multiturn.results import sim_model, write_all
from benchmarks.multiturn.runner import Context, execute
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.trace import DEFAULT_TRACE
from benchmarks.peers import SGLANG_ROUTER, SMG, PeerStatus, peer_status

WORKLOAD_NAMES = ("trace", "multi_round_qa", "sharegpt", "loogle", "react", "share_ratio", "pd")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multiturn",
        description="Multi-turn cache benchmarks: policies, peers and PD caching modes.",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/multiturn"))
    parser.add_argument("--quick", action="store_true", help="the < 5 minute preset")
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="a trace in Mooncake's format"
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOAD_NAMES,
        default=None,
        help="run only these parts (default: all of the preset)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="only these systems, e.g. 'ours prompt_tree' 'sglang-router cache_aware'",
    )
    parser.add_argument("--no-pd", action="store_true", help="skip the PD clusters")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite results.md, the targets and the plots from OUT/results.json",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV capacity per worker in tokens (default: the sim's modelled H100)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep every worker's and router's log here (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    if not args.trace.exists():
        parser.error(f"--trace {args.trace}: no such file")
    if args.report_only:
        return report_only(parser, args.out, args.trace)
    started = time.perf_counter()
    plan = make_plan(
        args.quick,
        args.trace,
        pd=not args.no_pd,
        workloads=set(args.workloads) if args.workloads else None,
        systems=set(args.systems) if args.systems else None,
    )
    if args.max_total_tokens:
        plan.max_total_tokens = args.max_total_tokens
    from connector.model_files import ensure_hf_model
    from connector.token_cache import CachedEncoder
    from connector.tokenizer import ChatTokenizer

    model_dir = ensure_hf_model()
    tokenizer = ChatTokenizer(model_dir)
    peers = {p: peer_status(p) for p in (SGLANG_ROUTER, SMG)}
    with (
        tempfile.TemporaryDirectory(prefix="multiturn-") as tmp,
        progress_bar(46) as progress,
    ):
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        ctx = Context(
            plan,
            model_dir,
            log_dir,
            tokenizer,
            CachedEncoder(tokenizer),
            Vocab.from_tokenizer(tokenizer),
            progress,
            peers,
        )
        records = execute(ctx)
    elapsed = time.perf_counter() - started
    write_all(
        args.out,
        plan,
        records,
        peers,
        elapsed,
        " ".join(["python -m benchmarks.multiturn", *(argv or sys.argv[1:])]),
    )
    print(f"multiturn: {plan.preset} run, {len(records)} runs in {elapsed:.0f} s -> {args.out}")
    print((args.out / "results.md").read_text().split("\n## Notes")[0])
    return 0


def report_only(parser: argparse.ArgumentParser, out: Path, trace: Path) -> int:
    """The report of an earlier run, made again from its measurements (say, after the report
    code changed); the runs themselves are kept as they were."""
    source = out / "results.json"
    try:
        figures = json.loads(source.read_text())
        runs, preset = figures["runs"], figures["preset"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--report-only: cannot read the runs from {source}: {exc}")
    plan = make_plan(preset == "quick", trace)
    capacity = figures.get("kv_capacity_tokens")  # the preset's, or --max-total-tokens
    plan.max_total_tokens = (
        None if capacity == sim_model()["kv_capacity_tokens_default"] else capacity
    )
    peers = {name: PeerStatus(**status) for name, status in figures.get("peers", {}).items()}
    machine = figures.get("machine") or None  # where the runs were measured
    elapsed, command = figures.get("elapsed_s", 0.0), figures.get("command", "")
    write_all(out, plan, runs, peers, elapsed, command, machine)
    print(f"multiturn: report of {len(runs)} runs rewritten in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
