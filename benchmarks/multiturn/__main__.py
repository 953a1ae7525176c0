"""`python -m benchmarks.multiturn --out DIR [--quick]`: see the package docstring."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import shown_command, stop_children_on_terminate
from benchmarks.multiturn.paired_report import write_paired
from benchmarks.multiturn.plan import make_plan
from benchmarks.multiturn.results import write_all
from benchmarks.multiturn.runner import Context, execute
from benchmarks.multiturn.trace import DEFAULT_TRACE
from benchmarks.peers import PeerStatus

DEFAULT_OUT = Path("benchmarks/results/multiturn")
WORKLOAD_NAMES = ("trace", "multi_round_qa", "sharegpt", "loogle", "react", "share_ratio", "pd")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multiturn",
        description="Multi-turn cache benchmarks: policies, peers and PD caching modes.",
    )
    add = parser.add_argument
    add("--out", type=Path, help="results directory (default: the preset's in benchmarks/results)")
    add("--quick", action="store_true", help="the preset's quick form (minutes, one seed)")
    for flag, what in (
        ("--capacity", "caches 2x-8x smaller than the working set"),
        ("--hot-prefix", "Zipf-popular shared prefixes at 85%% of the sustained rate"),
        ("--pd", "PD with several prefills, at 80%% of the sustained rate"),
        ("--sweep", "one factor at a time around a hot-prefix cell"),
        ("--lora", "20 LoRA adapters of Zipf popularity on 4 workers holding 4 each"),
        ("--tenants", "4 tenants sharing a public tool prompt, isolated or not, and fairness"),
    ):
        page = "hot-prefix" if flag == "--sweep" else flag[2:]
        add(flag, action="store_true", help=f"the preset of {what} (docs/benchmarks/{page}.md)")
    add("--cells", nargs="+", metavar="CELL", help="--sweep: only these cells, by name")
    add(
        "--calibration-from",
        type=Path,
        metavar="DIR",
        help="--hot-prefix/--pd/--sweep/--lora/--tenants: each config's sustained rate and KV "
        "sizing from DIR/results.json instead of measured (to split the seeds over invocations)",
    )
    add("--seeds", type=int, nargs="+", help="these workload seeds instead of the preset's")
    add("--multiples", type=float, nargs="+", help="--capacity/--pd: working set / cluster KV")
    add(
        "--trace",
        type=Path,
        help="a Mooncake-format trace, gzipped or plain (default: the shipped conversation "
        "trace; --hot-prefix: replayed open-loop instead of the synthetic workload)",
    )
    add("--workloads", nargs="+", choices=WORKLOAD_NAMES, help="only these parts of the preset")
    add(
        "--systems",
        nargs="+",
        help="only these systems, e.g. 'ours prompt_tree' (a PD preset's mode: 'ours "
        "prompt_tree [PD-Caching-3]')",
    )
    add("--no-pd", action="store_true", help="skip the PD clusters")
    add("--shapes", nargs="+", metavar="SHAPE", help="--hot-prefix/--pd: only these shapes")
    add("--report-only", action="store_true", help="rewrite the report from OUT/results.json")
    add(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        metavar="DIR",
        help="--report-only of --capacity or --sweep results: add these runs' to OUT's",
    )
    add("--max-total-tokens", type=int, help="KV per worker, tokens (default: the sim's H100)")
    add("--log-dir", type=Path, help="keep every process's log here (default: a temp dir)")
    args = parser.parse_args(argv)
    stop_children_on_terminate()
    from benchmarks.multiturn import paired_cli

    presets = {
        paired_cli.CAPACITY: args.capacity,
        paired_cli.HOT_PREFIX: args.hot_prefix,
        paired_cli.PD: args.pd,
        paired_cli.SWEEP: args.sweep,
        paired_cli.LORA: args.lora,
        paired_cli.TENANTS: args.tenants,
    }
    kind = next((k for k, asked in presets.items() if asked), None)
    for error, wrong in (
        (
            "--capacity, --hot-prefix, --pd, --sweep, --lora and --tenants are presets of their "
            "own: pick one",
            sum(presets.values()) > 1,
        ),
        (f"--trace {args.trace}: no such file", args.trace and not args.trace.exists()),
        (
            "--multiples belongs to --capacity and --pd",
            args.multiples and kind not in (paired_cli.CAPACITY, paired_cli.PD),
        ),
        ("--multiples must be positive", any(m <= 0 for m in args.multiples or ())),
        (
            "--shapes belongs to --hot-prefix and --pd",
            args.shapes and kind not in (paired_cli.HOT_PREFIX, paired_cli.PD),
        ),
        ("--cells belongs to --sweep", args.cells and kind is not paired_cli.SWEEP),
        (
            "--sweep runs its own hot-prefix cells: no --trace or --workloads",
            args.sweep and (args.trace or args.workloads),
        ),
        (
            "--lora runs its own LoRA workload: no --trace or --workloads",
            args.lora and (args.trace or args.workloads),
        ),
        (
            "--tenants runs its own tenants workload: no --trace or --workloads",
            args.tenants and (args.trace or args.workloads),
        ),
        (
            "--calibration-from belongs to --hot-prefix, --pd, --sweep, --lora and --tenants runs",
            args.calibration_from and (args.report_only or kind in (None, paired_cli.CAPACITY)),
        ),
        ("--merge belongs to --report-only", args.merge and not args.report_only),
        (
            "--max-total-tokens: a paired preset sizes the KV from the working set",
            args.max_total_tokens and kind,
        ),
    ):
        if wrong:
            parser.error(error)
    out = args.out or (kind.out if kind else DEFAULT_OUT)
    if args.report_only:
        return report_only(parser, out, args.merge)
    started = time.perf_counter()
    if kind is not None:
        with Context.open(args.log_dir) as session:
            figures = paired_cli.run(kind, parser, args, session)
        figures.update(elapsed_s=time.perf_counter() - started, command=command_line(argv))
        write_paired(out, kind, figures, session.peers)
        return finished(figures["preset"], len(figures["runs"]), started, out, kind.page)
    plan = make_plan(
        args.quick,
        args.trace or DEFAULT_TRACE,
        pd=not args.no_pd,
        workloads=set(args.workloads) if args.workloads else None,
        systems=set(args.systems) if args.systems else None,
        seeds=args.seeds or (),
    )
    if not plan.steps:
        parser.error("nothing to run: no step of the preset has those workloads and systems")
    plan.max_total_tokens = args.max_total_tokens or plan.max_total_tokens
    with Context.open(args.log_dir) as session:
        records = execute(session.context(plan))
    elapsed = time.perf_counter() - started
    figures = {"preset": plan.preset, "runs": records, "elapsed_s": elapsed}
    write_all(out, plan, {**figures, "command": command_line(argv)}, session.peers)
    return finished(plan.preset, len(records), started, out)


Session = Context  # (the overload suite opens one too)


def command_line(argv: Sequence[str] | None) -> str:
    return shown_command("python -m benchmarks.multiturn", argv or sys.argv[1:])


def finished(preset: str, runs: int, started: float, out: Path, page: str | None = None) -> int:
    elapsed = time.perf_counter() - started
    print(f"multiturn: {preset} run, {runs} runs in {elapsed:.0f} s -> {out}")
    print((out / (page or "results.md")).read_text().split("\n## Notes")[0])
    return 0


def report_only(parser: argparse.ArgumentParser, out: Path, merge: Sequence[Path] = ()) -> int:
    """The report of an earlier run, made again from its measurements (say, after the report
    code changed); the runs themselves are kept as they were."""
    source = out / "results.json"
    try:
        figures = json.loads(source.read_text())
        preset, _ = str(figures["preset"]), figures["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--report-only: cannot read the runs from {source}: {exc}")
    try:
        figures = merged(figures, [json.loads((d / "results.json").read_text()) for d in merge])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--merge: {exc}")
    peers = {name: PeerStatus(**status) for name, status in figures.get("peers", {}).items()}
    from benchmarks.multiturn import paired_cli

    if (kind := paired_cli.kind_of(preset)) is not None:
        write_paired(out, kind, figures, peers)
    else:
        write_all(out, None, figures, peers)
    print(f"multiturn: report of {len(figures['runs'])} runs rewritten in {out}")
    return 0


def merged(base: dict[str, Any], others: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Results of several invocations of one preset as one (capacity multiples, or sweep
    cells run apart): their runs side by side, the setups and calibrations united, the
    commands and times added up. Runs of one configuration must not appear twice, and the
    sim's model must be the same."""
    if not others:
        return base
    kind = _merge_kind(base)
    if any(_merge_kind(f) != kind for f in others):
        raise ValueError(f"only results of one kind merge (these are {kind} results)")
    out = copy.deepcopy(base)
    key = run_key if kind == "capacity" else paired_run_key
    seen = {key(r) for r in out["runs"]}
    for other in others:
        if other.get("sim_model") != out.get("sim_model"):
            raise ValueError("the runs were made with different sim latency models")
        for run in other["runs"]:
            if key(run) in seen:
                raise ValueError(f"two results hold the same run: {key(run)}")
            seen.add(key(run))
            out["runs"].append(run)
        for name, setup in (other.get("setup") or {}).items():
            mine = out.setdefault("setup", {}).setdefault(name, copy.deepcopy(setup))
            if kind == "capacity":  # a workload's sizing, per multiple and seed
                for part in ("instance_kv_tokens", "working_set_estimates"):
                    mine.setdefault(part, {}).update(setup.get(part) or {})
        out.setdefault("calibration", {}).update(other.get("calibration") or {})
        out["elapsed_s"] = out.get("elapsed_s", 0.0) + other.get("elapsed_s", 0.0)
        out["command"] = f"{out.get('command', '')}; {other.get('command', '')}"
    return out


def _merge_kind(figures: dict[str, Any]) -> str:
    preset = str(figures["preset"])
    if preset.startswith("capacity"):
        return "capacity"
    if preset.startswith("sweep"):  # the sweep, or its quick form: each with its own
        return preset
    raise ValueError(f"only capacity and sweep results merge, not {preset!r}")


def run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["workload"], run["multiple"], run["hicache_ratio"], run["seed"], run["system"])


def paired_run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["config"], run["seed"], run["system"])


if __name__ == "__main__":
    sys.exit(main())
