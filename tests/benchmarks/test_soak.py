"""The soak benchmark runs end to end (half a minute at 4 req/s) and writes sane files; its
client tells broken answers from good ones; its slope fit sees a leak; bad flags are one-line
errors.

No timing thresholds: the machines are shared and noisy, so latency and the memory verdict
are only checked for shape, never for value. The run's own correctness is asserted: no
unexpected error, every worker's MemPool balanced once the load stops, RSS sampled for every
process.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import children, rss_mib
from benchmarks.soak.analysis import memory, slope_mib_per_min
from benchmarks.soak.cluster import Proc, Sample
from benchmarks.soak.load import CHAT, GENERATE, Mix, Sessions
from tests.benchmarks.runs import PNG_MAGIC, REPO_ROOT, benchmark, finite, read_json

WORKERS = 3


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("soak")
    done = benchmark("soak", out, "--quick", timeout=150)
    assert done.returncode == 0, f"soak failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    assert "unexpected errors" in done.stdout
    return out


@pytest.fixture(scope="module")
def figures(out_dir: Path) -> dict[str, Any]:
    return read_json(out_dir / "results.json")


def test_files_are_written(out_dir: Path) -> None:
    for name in ("results.json", "results.md"):
        assert (out_dir / name).stat().st_size > 0, name
    for name in ("latency.png", "rss.png"):
        assert (out_dir / name).read_bytes().startswith(PNG_MAGIC), name
    md = (out_dir / "results.md").read_text()
    for heading in ("## Outcomes", "## Memory per process", "## MemPool accounting", "## Latency"):
        assert heading in md, heading
    assert "](latency.png)" in md and "](rss.png)" in md
    assert "MiB/min" in md  # the verdict's threshold is stated


def test_no_unexpected_errors_and_the_mix_ran(figures: dict[str, Any]) -> None:
    assert figures["unexpected_errors"] == 0, figures["errors"]
    assert figures["errors"] == []
    outcomes = {o["outcome"]: o for o in figures["outcomes"]}
    assert outcomes["ok"]["count"] > 50  # ~120 offered in 30 s at 4/s
    assert all(o["expected"] for o in figures["outcomes"])
    mix = figures["load"]["mix"]
    for kind in (f"{CHAT} stream", f"{CHAT} whole", f"{GENERATE} stream", f"{GENERATE} whole"):
        assert mix.get(kind, 0) > 0, mix
    assert figures["load"]["sessions"] < figures["load"]["offered"]  # sessions had turns
    assert figures["load"]["cached_share_of_prompt_tokens"] > 0  # histories were reused


def test_the_page_says_how_well_the_trees_predicted_the_workers_caches(
    out_dir: Path, figures: dict[str, Any]
) -> None:
    p = figures["prediction"]
    assert p["reported"] > 0, p  # histories were reused, and the router saw it
    assert 0.5 < p["ratio"] < 1.5, p  # the trees follow the caches (evicting all the time)
    assert (
        "Routing accuracy: the router's prefix trees predicted"
        in (out_dir / "results.md").read_text()
    )


def test_rss_is_sampled_for_every_process(figures: dict[str, Any]) -> None:
    rows = {r["process"]: r for r in figures["processes"]}
    roles = [r["role"] for r in rows.values()]
    assert roles.count("router") == 1 and roles.count("colocated") == WORKERS, roles
    for name, row in rows.items():
        points = figures["rss_series"][name]
        assert len(points) >= 5, (name, points)  # every 2 s over 30 s
        assert all(p[1] > 10 for p in points), name  # MiB of a Python process
        assert [p[0] for p in points] == sorted(p[0] for p in points)
        assert finite(row["slope_mib_per_min"]), row
        assert isinstance(row["flat"], bool)
    verdict = figures["verdict"]
    assert isinstance(verdict["memory_flat"], bool)
    assert verdict["threshold_mib_per_min"] > 0 and verdict["warmup_s"] == 15


def test_mempool_balanced_after_the_load(figures: dict[str, Any]) -> None:
    accounting = figures["mempool"]
    assert len(accounting) == WORKERS
    for w in accounting:
        assert w["balanced"], w
        assert w["used_blocks"] == w["indexed_blocks"] and w["protected_pages"] == 0, w
    evicted = sum(g.get("evicted_blocks", 0) for g in figures["gauges_end"].values())
    assert evicted > 0  # the small device KV did churn


def test_latency_per_window(figures: dict[str, Any]) -> None:
    windows = figures["windows"]
    assert len(windows) == 6  # 30 s in 5 s windows
    assert sum(w["requests"] for w in windows) == figures["load"]["offered"]
    lat = figures["latency"]
    assert lat["e2e_p99_ms"] >= lat["e2e_p50_ms"] > 0
    assert lat["ttft_p99_ms"] >= lat["ttft_p50_ms"] > 0
    assert lat["ttft_p50_ms"] <= lat["e2e_p99_ms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--minutes", "0", "--rps", "4"], "--minutes: must be > 0"),
        (["--minutes", "1", "--rps", "-1"], "--rps: must be > 0"),
        (["--minutes", "soon", "--rps", "4"], "--minutes: expected minutes"),
        (["--minutes", "1", "--rps", "nan"], "--rps: must be > 0"),
        (["--minutes", "1", "--quick"], "--quick and --minutes"),
        (["--minutes", "1", "--rps", "4", "--warmup-fraction", "1"], "--warmup-fraction"),
    ],
)
def test_bad_arguments_exit_with_one_clear_line(args: list[str], message: str) -> None:
    command = [sys.executable, "-m", "benchmarks.soak", *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ pieces, in process


def test_the_slope_fit_sees_a_leak_and_a_flat_line() -> None:
    flat = [[t, 100.0 + (0.3 if t % 20 else 0.0)] for t in range(0, 600, 2)]
    leak = [[t, 100.0 + 5.0 * t / 60] for t in range(0, 600, 2)]  # 5 MiB/min
    assert abs(slope_mib_per_min(flat) or 0) < 0.1
    assert slope_mib_per_min(leak) == pytest.approx(5.0)
    assert slope_mib_per_min(leak[:2]) is None
    samples = [
        Sample(t, {"a": a, "b": b}, {}, {}) for (t, a), (_, b) in zip(flat, leak, strict=True)
    ]
    procs = [Proc("a", 1, "router", ""), Proc("b", 2, "colocated", "")]
    rows, verdict = memory(samples, procs, warmup_s=300, threshold=1.0)
    flat_of = {r["process"]: r["flat"] for r in rows}
    assert flat_of == {"a": True, "b": False}
    assert verdict["memory_flat"] is False
    b = next(r for r in rows if r["process"] == "b")
    assert b["growth_after_warmup_mib"] == pytest.approx(5.0 * 298 / 60, abs=0.1)


def test_rss_of_this_process_and_its_children() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert (rss_mib(os.getpid()) or 0) > 10  # MiB of a Python process
        assert rss_mib(proc.pid) is not None
        assert proc.pid in children(os.getpid())
    finally:
        proc.kill()
        proc.wait()
    assert rss_mib(proc.pid) is None


def test_sessions_grow_their_histories_and_end() -> None:
    sessions = Sessions(Mix(), random.Random(1))
    rng = random.Random(2)
    s = sessions.next()
    s.ask(rng)
    first = s.prompt()
    s.answered("an answer")
    s.ask(rng)
    second = s.prompt()
    if s.api == CHAT:
        assert isinstance(first, list) and isinstance(second, list)
        assert second[: len(first)] == first
    else:
        assert isinstance(first, str) and isinstance(second, str)
        assert second.startswith(first)
    for _ in range(20):
        s.answered("x")
    assert s.done
    assert sessions.next() is not s
