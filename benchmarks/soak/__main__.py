"""`python -m benchmarks.soak [--quick | --minutes N] [--rps R] [--pd] [--out DIR]`.

Exits 0 when the run was clean (no unexpected error, every worker's MemPool balanced, no
process died), else 1; the memory verdict is reported, not an exit status (RSS on a shared
machine is too noisy to fail on alone). Bad arguments exit 2 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchmarks.soak as package
from benchmarks.harness import REPO_ROOT, progress_bar, run_async, shown_path
from benchmarks.soak import analysis
from benchmarks.soak.cluster import POLICY, Running, Sample, Sampler, mempool_accounting, start
from benchmarks.soak.load import LoadResult, run_load
from benchmarks.soak.report import NAME, write
from localrun.cluster import ClusterSpec

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "soak"
# The committed run's load, and the quick one the tests run.
FULL_MINUTES, FULL_RPS, QUICK_MINUTES = 10.0, 4.0, 0.5


@dataclass(frozen=True)
class Config:
    minutes: float
    rps: float
    out: Path
    pd: bool = False
    workers: int = 3  # colocated workers (PD: one prefill + one decode instead)
    max_total_tokens: int = 2048  # device KV per worker: small, so caches evict all the time
    time_scale: float = 0.5  # the sim's modelled GPU time x this is slept
    seed: int = 0
    sample_secs: float = 2.0
    warmup_fraction: float = 0.5  # RSS slope fitted on what follows (the second half)
    slope_threshold_mib_per_min: float = 1.0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_s(self) -> float:
        return self.duration_s * self.warmup_fraction

    @property
    def window_s(self) -> float:
        """About 20 latency windows over the run, 5..60 s each."""
        return min(60.0, max(5.0, self.duration_s / 20))

    def cluster(self) -> ClusterSpec:
        """3 colocated sim workers, or one caching-3 prefill and decode pair (`--pd`)."""
        pd = self.pd
        return ClusterSpec(
            "soak-pd" if pd else "soak",
            colocated=0 if pd else self.workers,
            prefills=int(pd),
            decodes=int(pd),
            caching="caching-3" if pd else None,
            label="1P1D-CC" if pd else "",
            time_scale=self.time_scale,
            max_total_tokens=self.max_total_tokens,
        )


def number(
    what: str, ok: Callable[[float], bool] = lambda v: v > 0, rule: str = "> 0"
) -> Callable[[str], float]:
    """An argparse type: a finite float for which `ok` holds, else one line naming its unit."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule} ({what}), got {text}")
        return value

    return parse


def parse_args(argv: Sequence[str] | None) -> Config:
    description = (package.__doc__ or "soak").splitlines()[0]
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=description)
    p.add_argument(
        "--minutes",
        type=number("minutes of load"),
        help=f"default {FULL_MINUTES:g} (--quick: {QUICK_MINUTES:g})",
    )
    p.add_argument("--rps", type=number("requests per second"))
    p.add_argument("--quick", action="store_true", help="half a minute of load (the tests')")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default benchmarks/results/soak")
    p.add_argument("--pd", action="store_true", help="one prefill + one decode worker")
    p.add_argument(
        "--warmup-fraction",
        type=number("a number in [0, 1)", lambda v: 0 <= v < 1, "in [0, 1)"),
        default=Config.warmup_fraction,
        help="share of the run before RSS must be flat (default %(default)s)",
    )
    p.add_argument(
        "--slope-threshold",
        type=number("MiB per minute"),
        default=Config.slope_threshold_mib_per_min,
        help="an RSS slope above this after warm-up is not flat (default %(default)s MiB/min)",
    )
    a = p.parse_args(argv)
    if a.quick and a.minutes is not None:
        p.error("--quick and --minutes: the quick run is half a minute; give one of them")
    return Config(
        minutes=a.minutes or (QUICK_MINUTES if a.quick else FULL_MINUTES),
        rps=a.rps or FULL_RPS,
        out=a.out,
        pd=a.pd,
        warmup_fraction=a.warmup_fraction,
        slope_threshold_mib_per_min=a.slope_threshold,
    )


async def soak(config: Config, running: Running, progress: Any) -> tuple[LoadResult, Sampler]:
    """The load and the sampler side by side; the sampler's last sample once every answer
    is in."""
    tally: Counter[str] = Counter()
    task = progress.add_task("soak", total=round(config.duration_s))
    origin = time.perf_counter()
    sampler = Sampler(running.procs(), config.sample_secs, origin)

    def on_sample(sample: Sample) -> None:
        rss = sum(sample.rss_mib.values())
        desc = f"soak: {tally['done']} answered, {tally['errors']} errors, RSS {rss:.0f} MiB"
        progress.update(task, completed=min(sample.t, config.duration_s), description=desc)
        progress.refresh()

    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop, on_sample))
    try:
        load = await run_load(
            running.router.url,
            config.rps,
            config.duration_s,
            config.seed,
            lambda r: tally.update(done=1, errors=int(r.failed)),
            origin=origin,
        )
    finally:
        stop.set()
        await sampling
    progress.update(task, completed=config.duration_s)
    progress.refresh()
    return load, sampler


def figures(config: Config, load: LoadResult, sampler: Sampler, running: Running) -> dict[str, Any]:
    """The run's figures, the MemPool check (once the load has stopped) among them."""
    records, samples, exited = load.records, sampler.samples, sampler.exited
    accounting = mempool_accounting(running.cluster)
    rows, verdict = analysis.memory(
        samples, sampler.procs, config.warmup_s, config.slope_threshold_mib_per_min
    )
    windows = analysis.windows(records, config.window_s, config.duration_s)
    errors = analysis.error_list(records)
    codes = {name: server.exited() for name, server in running.servers().items()}
    died = [
        {
            "process": name,
            "missing_at_s": round(exited.get(name, -1), 1),
            "exit_code": codes.get(name),
        }
        for name in sorted(set(exited) | {n for n, c in codes.items() if c is not None})
    ]
    shown = {"out": shown_path(config.out), "window_s": config.window_s, "policy": POLICY}
    gauges_end = samples[-1].gauges if samples else {}
    fig: dict[str, Any] = {
        "config": asdict(config) | shown,
        "load": {
            "offered": len(records),
            "sessions": load.sessions,
            "elapsed_s": round(load.elapsed_s, 2),
            "achieved_rps": round(len(records) / config.duration_s, 3),
            "mix": analysis.mix(records),
            "cached_share_of_prompt_tokens": analysis.cache_share(records),
        },
        "outcomes": analysis.outcomes(records),
        "aborts": {  # an abandoned stream may finish on its worker before the close arrives
            "abandoned_streams": sum(1 for r in records if r.outcome == "abandoned"),
            "worker_aborted_requests": sum(g.get("aborted", 0) for g in gauges_end.values()),
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
        "gauges_end": gauges_end,
        "prediction": analysis.prediction(gauges_end),
        "exited": died,
    }
    if errors or died or not all(w["balanced"] for w in accounting):
        fig["log_tails"] = {name: s.tail(12) for name, s in running.servers().items()}
    return fig


def run(config: Config) -> dict[str, Any]:
    from connector.model_files import ensure_hf_model

    started = time.perf_counter()
    model_dir = ensure_hf_model()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, progress_bar() as progress:
        boot = progress.add_task("start the cluster and the router", total=1)
        progress.refresh()
        running = start(config.cluster(), model_dir, Path(tmp))
        try:
            progress.update(boot, completed=1)
            progress.refresh()
            load, sampler = run_async(soak(config, running, progress))
            fig = figures(config, load, sampler, running)
        finally:
            running.stop()
    fig["elapsed_s"] = round(time.perf_counter() - started, 1)
    write(config.out, fig)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    fig = run(config)
    print(f"soak: {fig['elapsed_s']:.0f} s -> {config.out}")
    print((config.out / f"{NAME}.md").read_text().split("\n## ")[0])
    clean = fig["unexpected_errors"] == 0 and not fig["exited"]
    return 0 if clean and all(w["balanced"] for w in fig["mempool"]) else 1


if __name__ == "__main__":
    sys.exit(main())
