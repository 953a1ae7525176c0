"""`python -m benchmarks.reliability [--out DIR] [--quick] [--only NAME ...]`: inject faults
into real router and worker processes, send bad inputs, write results.json and results.md."""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import REPO_ROOT, progress_bar, step
from benchmarks.reliability import faults, pressure, tenants
from benchmarks.reliability.bad_inputs import bad_inputs
from benchmarks.reliability.cluster import Cluster, cluster
from benchmarks.reliability.faults import Scenario, Settings
from benchmarks.reliability.http_limits import http_limits
from benchmarks.reliability.report import FaultResult, InputResult, LimitResult, publish

SCENARIOS = {s.__name__: s for s in [*faults.SCENARIOS, *pressure.SCENARIOS, *tenants.SCENARIOS]}
STEPS = [*SCENARIOS, "bad_inputs", "http_limits"]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__)
    p.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results" / "reliability",
        help="directory for the results",
    )
    p.add_argument("--quick", action="store_true", help="fewer requests and flaps (same scenarios)")
    p.add_argument("--only", nargs="+", choices=STEPS, help="run these scenarios only")
    return p.parse_args(argv)


def run_scenario(c: Cluster, scenario: Scenario, settings: Settings) -> FaultResult:
    """A scenario that breaks is a failed row, not a crash."""
    try:
        return scenario(c, settings)
    except Exception as exc:
        result = FaultResult(scenario.__name__.replace("_", " "), "(did not run to the end)")
        result.error = f"{type(exc).__name__}: {exc}"
        result.notes.append(traceback.format_exc(limit=3).replace("\n", " "))
        return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from connector.model_files import ensure_hf_model

    model_dir = ensure_hf_model()
    settings = Settings(requests=4, flaps=2, load_threads=2) if args.quick else Settings()
    chosen = [name for name in STEPS if args.only is None or name in args.only]
    logs = Path(tempfile.mkdtemp(prefix="reliability-"))  # kept: the servers' logs
    started = time.monotonic()
    results: list[FaultResult] = []
    inputs: list[InputResult] = []
    limits: list[LimitResult] = []
    with progress_bar() as progress:
        task = progress.add_task("faults, bad inputs, attacks", total=len(chosen))
        for name in chosen:  # each on its own processes
            progress.update(task, description=name)
            with cluster(logs / name, model_dir) as c:
                if name == "bad_inputs":
                    inputs = bad_inputs(c)
                elif name == "http_limits":
                    limits = http_limits(c)
                else:
                    results.append(run_scenario(c, SCENARIOS[name], settings))
            step(progress, task)
    mode = "quick" if args.quick else "full"
    total = publish(args.out, mode, results, inputs, limits, time.monotonic() - started)
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
