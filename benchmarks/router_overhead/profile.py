"""Where our router's CPU goes at its maximum rate: py-spy on the thread holding the GIL
(`--gil`: the Python work and what it calls), native frames included, summed by function
(self time) and by project module (inclusive). Without py-spy the run says so and goes on."""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.router_overhead.phases import max_rps
from benchmarks.router_overhead.settings import Settings
from benchmarks.router_overhead.systems import System

RATE_HZ = 250
TOP = 12
# a py-spy raw frame: "function (file:line)"; native frames have no line, or no file
FRAME = re.compile(r"^(?P<fn>.*?)(?: \((?P<file>[^():]*)(?::\d+)?\))?$")
# the project's packages, as they appear in frames' file names
PACKAGES = ("router/", "shared/", "mempool/", "connector/")


def frame_key(frame: str) -> tuple[str, str]:
    """(function, file) of one raw frame; file is '' for a native frame without one."""
    m = FRAME.match(frame.strip())
    fn, where = (m.group("fn"), m.group("file") or "") if m else (frame, "")
    return fn, where


def module_of(where: str) -> str | None:
    """The project module a frame's file belongs to (`router/policies.py`), or None."""
    for package in PACKAGES:
        at = where.find(package)
        if at >= 0 and where.endswith(".py"):
            return where[at:]
    return None


def summarize(raw: str) -> dict[str, Any]:
    """py-spy's raw (folded) output as the top functions by self time and the project's
    modules by inclusive time, each as a share of all samples."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        fn, where = frame_key(frames[-1])
        self_time[f"{fn} ({Path(where).name})" if where else fn] += n
        for module in {m for f in frames if (m := module_of(frame_key(f)[1]))}:
            inclusive[module] += n
    if not total:
        return {"samples": 0, "self": [], "inclusive": []}

    def shares(counter: Counter[str]) -> list[dict[str, Any]]:
        # a module on every stack (the entry point, the server's loop) says nothing
        kept = [(k, v) for k, v in counter.most_common() if v < total * 0.99]
        return [{"name": k, "share": v / total} for k, v in kept[:TOP]]

    return {"samples": total, "self": shares(self_time), "inclusive": shares(inclusive)}


async def profile_ours(
    systems: list[System], payloads: list[bytes], settings: Settings, out_dir: Path
) -> dict[str, Any]:
    """Sample ours prompt_tree, one process on the smallest CPU set, while max-rate clients
    keep it busy; the raw samples go to out_dir/profile.txt (the run's log folder: MBs)."""
    live = (s for s in systems if s.kind == "ours" and s.policy == "prompt_tree" and s.available)
    ours = next(live, None)
    if ours is None or ours.server is None:
        return {"available": False, "reason": "ours did not run"}
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return {"available": False, "reason": "py-spy is not installed"}
    seconds = max(settings.rps_duration_s, 5.0)
    out = out_dir / "profile.txt"
    command = [py_spy, "record", "--native", "--gil", "--rate", str(RATE_HZ)]
    command += ["--duration", str(int(seconds)), "--format", "raw", "--output", str(out)]
    command += ["--pid", str(ours.server.proc.pid)]
    spy = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    await max_rps(ours.rps_urls, payloads, settings, seconds, None)
    _, err = await spy.communicate()
    if spy.returncode != 0 or not out.is_file():
        why = err.decode(errors="replace").strip().splitlines()
        return {"available": False, "reason": f"py-spy failed: {why[0] if why else spy.returncode}"}
    summary = summarize(out.read_text())
    return {"available": True, "system": ours.name, "seconds": seconds, **summary}


def section(fig: dict[str, Any] | None) -> list[str]:
    """The profile's lines on the results page."""
    lines = ["## Profile at the maximum rate", ""]
    if not fig or not fig.get("available"):
        reason = (fig or {}).get("reason", "not run")
        return [*lines, f"No profile in this run: {reason}.", ""]
    lines += [
        f"py-spy (`--native --gil`, {RATE_HZ} Hz) on `{fig['system']}` for {fig['seconds']:g} "
        f"s at the maximum rate: {fig['samples']:,} samples of the router's thread holding the "
        "GIL (the Python work and what it calls). Self time is the function on top of the "
        "stack; a module's inclusive time counts every sample that passes through it.",
        "",
        "| self time | share | | project module (inclusive) | share |",
        "|---|---|---|---|---|",
    ]
    for a, b in itertools.zip_longest(fig["self"], fig["inclusive"]):
        left = f"`{a['name']}` | {a['share']:.1%}" if a else " | "
        right = f"`{b['name']}` | {b['share']:.1%}" if b else " | "
        lines.append(f"| {left} | | {right} |")
    return [*lines, ""]
