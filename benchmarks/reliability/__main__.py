"""`python -m benchmarks.reliability [--out DIR] [--quick] [--only NAME ...]`: inject faults
into real router and worker processes, send bad inputs, write results.json and results.md."""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.harness import REPO_ROOT, progress_bar, step
from benchmarks.reliability import bad_inputs, faults, http_limits, pd_faults, pressure, tenants
from benchmarks.reliability.cluster import Cluster, cluster
from benchmarks.reliability.faults import Settings
from benchmarks.reliability.http_limits import LimitResult
from benchmarks.reliability.report import FaultResult, InputResult, counts, publish

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "reliability"
Scenario = Callable[[Cluster, Settings], FaultResult]
ALL: list[Scenario] = [
    *faults.SCENARIOS,
    *pd_faults.SCENARIOS,
    *pressure.SCENARIOS,
    *tenants.SCENARIOS,
]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the results")
    p.add_argument("--quick", action="store_true", help="fewer requests and flaps (same scenarios)")
    p.add_argument(
        "--only",
        nargs="+",
        choices=[s.__name__ for s in ALL] + ["bad_inputs", "http_limits"],
        help="run these scenarios only",
    )
    return p.parse_args(argv)


def run_scenario(
    scenario: Scenario, logs: Path, model_dir: Path, settings: Settings
) -> FaultResult:
    """One scenario on its own processes; a scenario that breaks is a failed row, not a crash."""
    with cluster(logs / scenario.__name__, model_dir) as c:
        try:
            return scenario(c, settings)
        except Exception as exc:
            name = scenario.__name__.replace("_", " ")
            result = FaultResult(name, "(did not run to the end)", bound_s=faults.BOUND_S)
            result.error = f"{type(exc).__name__}: {exc}"
            result.notes.append(traceback.format_exc(limit=3).replace("\n", " "))
            return result


def run_inputs(logs: Path, model_dir: Path) -> list[InputResult]:
    with cluster(logs / "bad_inputs", model_dir) as c:
        (worker,) = c.workers(1)
        router = c.colocated_router(
            [worker], "--max-payload-size", str(bad_inputs.ROUTER_MAX_PAYLOAD)
        )
        return bad_inputs.run_all(router.url, worker.url)


def run_limits(logs: Path, model_dir: Path) -> list[LimitResult]:
    with cluster(logs / "http_limits", model_dir) as c:
        (worker,) = c.workers(1)
        return http_limits.run_all(c.colocated_router([worker], *http_limits.ROUTER_ARGS))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from connector.model_files import ensure_hf_model

    model_dir = ensure_hf_model()
    settings = (
        Settings(requests=4, flaps=2, load_threads=2, quick=True) if args.quick else Settings()
    )
    chosen = [s for s in ALL if args.only is None or s.__name__ in args.only]
    with_inputs = args.only is None or "bad_inputs" in args.only
    with_limits = args.only is None or "http_limits" in args.only
    logs = Path(tempfile.mkdtemp(prefix="reliability-"))  # kept: the servers' logs
    started = time.monotonic()
    results: list[FaultResult] = []
    inputs: list[InputResult] = []
    limits: list[LimitResult] = []
    with progress_bar() as progress:
        steps = len(chosen) + with_inputs + with_limits
        task = progress.add_task("faults, bad inputs, attacks", total=steps)
        for scenario in chosen:
            progress.update(task, description=scenario.__name__)
            results.append(run_scenario(scenario, logs, model_dir, settings))
            step(progress, task)
        if with_inputs:
            progress.update(task, description="bad inputs")
            inputs = run_inputs(logs, model_dir)
            step(progress, task)
        if with_limits:
            progress.update(task, description="attacks on the HTTP server")
            limits = run_limits(logs, model_dir)
            step(progress, task)
    mode = "quick" if args.quick else "full"
    publish(args.out, mode, results, inputs, limits, time.monotonic() - started)
    total = counts(results, inputs, limits)
    print(
        f"reliability ({mode}): faults {total['faults_passed']}/{total['faults_tried']} passed, "
        f"bad inputs {total['inputs_passed']}/{total['inputs_tried']} passed, attacks "
        f"{total['attacks_passed']}/{total['attacks_tried']} passed -> {args.out} "
        f"(server logs in {logs})"
    )
    print((args.out / "results.md").read_text().split("### What each")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
