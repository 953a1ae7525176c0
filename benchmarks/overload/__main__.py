"""`python -m benchmarks.overload [--out DIR] [--quick] [--seeds ...]`: see the package doc."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import step as advance
from benchmarks.harness import stop_children_on_terminate
from benchmarks.load.bodies import served_model
from benchmarks.multiturn.__main__ import Session
from benchmarks.multiturn.cluster import RouterSpec, scaled_cost_args
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.results import sim_model
from benchmarks.multiturn.trace import DEFAULT_TRACE
from benchmarks.overload import calibrate, report
from benchmarks.overload.preset import INSTANCES, Preset, preset_for, systems
from benchmarks.overload.runner import Bench, run_one
from benchmarks.overload.workload import (
    Pool,
    build_pool,
    mean_floor_s,
    oracle_floors,
    step_workload,
)
from benchmarks.peers import OURS, SGLANG_ROUTER
from localrun.cluster import Cluster, ClusterSpec

DEFAULT_OUT = Path("benchmarks/results/overload")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overload",
        description="Overload ramp: goodput and TTFT of admitted requests, 50-150% of the "
        "sustained rate, ours with and without admission by expected wait and sglang-router.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--quick", action="store_true", help="the quick preset (about 1.5 min)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="workload seeds")
    parser.add_argument(
        "--steps",
        type=float,
        nargs="+",
        default=None,
        help="offered load per step as fractions of the sustained rate (default 0.5 .. 1.5)",
    )
    parser.add_argument(
        "--sustained-rate",
        type=float,
        default=None,
        help="use this rate (req/s) instead of measuring it",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite results.md and the plot from OUT/results.json",
    )
    args = parser.parse_args(argv)
    if any(f <= 0 for f in args.steps or ()):
        parser.error("--steps must be positive")
    if args.sustained_rate is not None and not args.sustained_rate > 0:
        parser.error("--sustained-rate must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_children_on_terminate()
    command = " ".join(["python -m benchmarks.overload", *(sys.argv[1:] if argv is None else argv)])
    if args.report_only:
        return report_only(args.out)
    preset = preset_for(args.quick, tuple(args.seeds or ()), tuple(args.steps or ()))
    started = time.perf_counter()
    with Session.open(None) as session:
        ramp = Ramp(preset, session, DEFAULT_TRACE)
        setup, runs = ramp.run(args.sustained_rate)
    elapsed = time.perf_counter() - started
    peers = {name: s.__dict__ for name, s in session.peers.items() if name == SGLANG_ROUTER}
    measured = {"preset": preset.name, "command": command, "elapsed_s": elapsed}
    report.write(args.out, {**measured, "setup": setup, "runs": runs, "peers": peers})
    print(f"overload: {preset.name} run, {len(runs)} runs in {elapsed:.0f} s -> {args.out}")
    print((args.out / "results.md").read_text().split("\n## Goodput against")[0])
    return 0


@dataclass
class Ramp:
    """One invocation: the pools, the cluster, the calibration, then every step."""

    preset: Preset
    session: Session
    trace: Path

    def pool(self, seed: int, sessions: int) -> Pool:
        p = self.preset
        return build_pool(
            self.trace, self.session.vocab, seed, sessions, p.max_input_tokens, p.max_output_tokens
        )

    def run(self, sustained: float | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        p, s = self.preset, self.session
        spec = ClusterSpec("ov", colocated=INSTANCES, label="4 colocated", time_scale=p.time_scale)
        boot = s.progress.add_task(f"start {INSTANCES} sim workers", total=1)
        s.progress.refresh()
        cluster = Cluster.create(spec, s.model_dir, s.log_dir, None)
        try:
            cluster.start()
            advance(s.progress, boot)
            info = cluster.server_info()[0]
            bench = Bench(
                cluster,
                served_model(cluster.workers[0].url),
                Floor.of_worker(info),
                s.log_dir,
                s.progress,
            )
            return self._ramp(bench, info, sustained)
        finally:
            cluster.stop()

    def _ramp(
        self, bench: Bench, info: dict[str, Any], sustained: float | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        p = self.preset
        pools = {seed: self.pool(seed, p.sessions) for seed in p.seeds}
        first = pools[p.seeds[0]]
        # the deadline comes from the first pool as a whole (every step's rows are from it)
        mean_floor = mean_floor_s(step_workload(first, 1.0, len(first), "D"), bench.floor)
        deadline = p.deadline_multiple * mean_floor
        cost = scaled_cost_args(bench.floor.time_scale)  # what the cluster gives ours
        compared = systems(deadline, p.queue_size)
        reference = compared[1]  # ours without the deadline measures the sustained rate
        rungs: list[calibrate.Rung] = []
        if sustained is None:
            rungs = self._calibrate(bench, first, reference, deadline, INSTANCES / mean_floor)
            sustained = calibrate.sustained_rate(rungs)
            if sustained is None:
                raise RuntimeError("calibration: no offered rate held (see the rungs)")
        needed = math.ceil(max(p.fractions) * sustained * p.step_duration_s)
        for seed, pool in pools.items():
            if len(pool) < needed:  # more whole sessions, in proportion
                pools[seed] = self.pool(seed, math.ceil(p.sessions * needed / len(pool) * 1.1))
        peers_ok = self.session.peers[SGLANG_ROUTER].importable
        skipped = (
            [] if peers_ok else [f"{SGLANG_ROUTER}: {self.session.peers[SGLANG_ROUTER].reason}"]
        )
        ramp = [spec for spec in compared if spec.router == OURS or peers_ok]
        runs = self._steps(bench, pools, ramp, sustained, deadline, skipped)
        setup = {
            "preset": p.name,
            "instances": INSTANCES,
            "time_scale": p.time_scale,
            "kv_capacity_tokens": info.get("max_total_num_tokens"),
            "chunked_prefill_size": info.get("chunked_prefill_size"),
            "sim_model": sim_model(),
            "mean_floor_s": mean_floor,
            "floor_bound_rps": INSTANCES / mean_floor,
            "deadline_multiple": p.deadline_multiple,
            "deadline_s": deadline,
            "queue_size": p.queue_size,
            "cost_model_args": list(cost),
            "systems": {spec.name: list(spec.args) for spec in compared},
            "sustained_rps": sustained,
            "sustained_given": not rungs,
            "calibration": [r.describe() for r in rungs],
            "calibration_seed": p.seeds[0],
            "calibration_duration_s": p.calibration.duration_s,
            "step_duration_s": p.step_duration_s,
            "fractions": list(p.fractions),
            "seeds": list(p.seeds),
            "workload": {k: v for k, v in first.params.items() if k != "requests"},
            "pool_requests": {str(seed): len(pool) for seed, pool in pools.items()},
            "skipped": skipped,
        }
        return setup, runs

    def _calibrate(
        self, bench: Bench, pool: Pool, system: RouterSpec, deadline: float, bound: float
    ) -> list[calibrate.Rung]:
        config = self.preset.calibration
        task = bench.progress.add_task("calibrate the sustained rate", total=config.max_rungs)

        def measure(rate: float) -> tuple[float, float | None]:
            count = max(2, round(rate * config.duration_s))
            workload = step_workload(pool, rate, count, f"calibrate:{rate:.4f}")
            floors = oracle_floors(workload.requests, bench.floor)
            label = f"calibrate @{rate:.2f}/s"
            record = run_one(bench, system, workload, floors, deadline, label)
            advance(bench.progress, task)
            return record["steady_rps"] or 0.0, record["slo_share"]

        rungs = calibrate.climb(config.start_fraction * bound, config, measure)
        bench.progress.update(task, total=len(rungs), completed=len(rungs))
        return rungs

    def _steps(
        self,
        bench: Bench,
        pools: dict[int, Pool],
        compared: Sequence[RouterSpec],
        sustained: float,
        deadline: float,
        skipped: list[str],
    ) -> list[dict[str, Any]]:
        p = self.preset
        total = len(pools) * len(p.fractions) * len(compared)
        overall = bench.progress.add_task("ramp runs", total=total)
        runs: list[dict[str, Any]] = []
        rotation = 0
        for seed, pool in pools.items():
            for fraction in p.fractions:
                rate = fraction * sustained
                workload = step_workload(pool, rate, round(rate * p.step_duration_s), f"{fraction}")
                floors = oracle_floors(workload.requests, bench.floor)
                k = rotation % len(compared)  # no system always first (drift, warm CPUs)
                rotation += 1
                for system in [*compared[k:], *compared[:k]]:
                    label = f"seed {seed} {fraction:.0%} {system.name}"
                    try:
                        record = run_one(bench, system, workload, floors, deadline, label)
                    except RuntimeError as exc:
                        if system.router == OURS:
                            raise
                        skipped.append(f"{system.name} at {fraction:.0%}, seed {seed}: {exc}"[:300])
                        continue
                    record["fraction"] = fraction
                    runs.append(record)
                    advance(bench.progress, overall)
        return runs


def report_only(out: Path) -> int:
    """The report of an earlier run made again from its results.json."""
    source = out / "results.json"
    try:
        figures = json.loads(source.read_text())
        report.write(out, figures, figures.get("machine") or None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"--report-only: cannot rebuild the report from {source}: {exc}", file=sys.stderr)
        return 2
    print(f"overload: report of {len(figures['runs'])} runs rewritten in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
