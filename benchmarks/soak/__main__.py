"""`python -m benchmarks.soak --minutes N --rps R [--pd] [--out DIR]`: see the package docstring.

Exits 0 when the run was clean (no unexpected error, every worker's MemPool balanced, no
process died), 1 otherwise; the memory verdict is reported, not turned into an exit status
(RSS on a shared machine is too noisy to fail on alone). Bad arguments exit 2 with one line.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchmarks.soak as package
from benchmarks.harness import progress_bar, run_async, shown_path
from benchmarks.load.record import Record
from benchmarks.soak import analysis
from benchmarks.soak.cluster import POLICY, Running, mempool_accounting, start
from benchmarks.soak.config import Config, parse_args
from benchmarks.soak.load import LoadResult, run_load
from benchmarks.soak.plots import plot
from benchmarks.soak.report import NAME, write
from benchmarks.soak.sampler import Proc, Sample, Sampler


@dataclass
class Tally:
    """What the progress bar shows while the load runs."""

    done: int = 0
    errors: int = 0

    def add(self, record: Record) -> None:
        self.done += 1
        self.errors += record.failed


async def soak(
    config: Config, procs: list[Proc], url: str, progress: Any
) -> tuple[LoadResult, list[Sample], dict[str, float]]:
    """The load and the sampler side by side; the sampler takes one last sample once every
    answer is in."""
    tally = Tally()
    task = progress.add_task("soak", total=round(config.duration_s))
    origin = time.perf_counter()
    sampler = Sampler(procs, config.sample_secs, origin)

    def on_sample(sample: Sample) -> None:
        rss = sum(sample.rss_mib.values())
        desc = f"soak: {tally.done} answered, {tally.errors} errors, RSS {rss:.0f} MiB"
        progress.update(task, completed=min(sample.t, config.duration_s), description=desc)
        progress.refresh()

    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop, on_sample))
    try:
        load = await run_load(
            url, config.rps, config.duration_s, config.seed, tally.add, origin=origin
        )
    finally:
        stop.set()
        await sampling
    progress.update(task, completed=config.duration_s)
    progress.refresh()
    return load, sampler.samples, sampler.exited


def figures(
    config: Config,
    load: LoadResult,
    samples: list[Sample],
    procs: list[Proc],
    accounting: list[dict[str, Any]],
    exited: dict[str, float],
    running: Running,
) -> dict[str, Any]:
    records = load.records
    rows, verdict = analysis.memory(
        samples, procs, config.warmup_s, config.slope_threshold_mib_per_min
    )
    windows = analysis.windows(records, config.window_s, config.duration_s)
    errors = analysis.error_list(records)
    codes = running.exit_codes()
    died = [
        {
            "process": name,
            "missing_at_s": round(exited.get(name, -1), 1),
            "exit_code": codes.get(name),
        }
        for name in sorted(set(exited) | {n for n, c in codes.items() if c is not None})
    ]
    config_dict = {**asdict(config), "out": shown_path(config.out), "window_s": config.window_s}
    fig: dict[str, Any] = {
        "config": {**config_dict, "policy": POLICY},
        "load": {
            "offered": load.offered,
            "sessions": load.sessions,
            "elapsed_s": round(load.elapsed_s, 2),
            "achieved_rps": round(load.offered / config.duration_s, 3),
            "mix": analysis.mix(records),
            "cached_share_of_prompt_tokens": analysis.cache_share(records),
        },
        "outcomes": analysis.outcomes(records),
        "aborts": {  # an abandoned stream may finish on its worker before the close arrives
            "abandoned_streams": sum(1 for r in records if r.outcome == "abandoned"),
            "worker_aborted_requests": sum(
                g.get("aborted", 0) for g in (samples[-1].gauges if samples else {}).values()
            ),
        },
        "unexpected_errors": sum(1 for r in records if r.failed),
        "errors": errors,
        "latency": analysis.latency(records),
        "windows": windows,
        "e2e_p99_range_ms": analysis.p99_range(windows, "e2e_p99_ms"),
        "ttft_p99_range_ms": analysis.p99_range(windows, "ttft_p99_ms"),
        "processes": rows,
        "verdict": verdict,
        "mempool": accounting,
        "rss_series": analysis.series(samples),
        "gauge_series": analysis.gauge_series(samples),
        "gauges_end": samples[-1].gauges if samples else {},
        "exited": died,
    }
    if errors or died or not all(w["balanced"] for w in accounting):
        fig["log_tails"] = running.log_tails()
    return fig


def run(config: Config) -> dict[str, Any]:
    from connector.model_files import ensure_hf_model

    started = time.perf_counter()
    model_dir = ensure_hf_model()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, progress_bar() as progress:
        boot = progress.add_task("start the cluster and the router", total=1)
        progress.refresh()
        running = start(config, model_dir, Path(tmp))
        try:
            progress.update(boot, completed=1)
            progress.refresh()
            procs = running.procs()
            load, samples, exited = run_async(soak(config, procs, running.url, progress))
            accounting = mempool_accounting(running)
            fig = figures(config, load, samples, procs, accounting, exited, running)
        finally:
            running.stop()
    fig["elapsed_s"] = round(time.perf_counter() - started, 1)
    write(config.out, fig)
    plot(config.out, fig)
    return fig


def clean(fig: dict[str, Any]) -> bool:
    balanced = all(w["balanced"] for w in fig["mempool"])
    return fig["unexpected_errors"] == 0 and balanced and not fig["exited"]


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv, (package.__doc__ or "soak").splitlines()[0])
    fig = run(config)
    print(f"soak: {fig['elapsed_s']:.0f} s -> {config.out}")
    print((config.out / f"{NAME}.md").read_text().split("\n## ")[0])
    return 0 if clean(fig) else 1


if __name__ == "__main__":
    sys.exit(main())
