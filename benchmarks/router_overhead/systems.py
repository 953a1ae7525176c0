"""The processes: two sim workers and, in front of the very same workers, each system
compared, every one on a free loopback port, each router pinned (taskset) to a CPU set of
1 and of 2 cores; the workers and the client are not pinned."""

from __future__ import annotations

import functools
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import OFFLINE_ENV, REPO_ROOT
from benchmarks.load.bodies import CHAT
from benchmarks.load.record import Record
from benchmarks.peers import OURS, SGLANG_ROUTER, SMG, PeerStatus, peer_command
from benchmarks.router_overhead.settings import CORE_COUNTS
from localrun.processes import (
    Launch,
    Server,
    free_port,
    http_ok,
    module_command,
    wait_until,
)

WORKERS = 2
FLOOR = "python floor"
# The floor on the other HTTP libraries (issue 35: the router's server and client chosen by
# these figures), on the 1-core set: (label, floor_proxy's flags)
FLOOR_VARIANTS = [
    ("python floor [granian]", ["--server", "granian"]),
    ("python floor [uvicorn]", ["--server", "uvicorn"]),
    ("python floor [aiohttp client]", ["--client", "aiohttp"]),
    ("python floor [aiosonic client]", ["--client", "aiosonic"]),
]
BEFORE = "ours [before]"  # --before DIR: an earlier commit's router, run from DIR
FLOOR_MODULE = "benchmarks.router_overhead.floor_proxy"
WORKER_ARGS = ["--backend", "sim", "--time-scale", "0", "--tokenizer-cache"]


def worker_launches(model_dir: Path, log_dir: Path) -> list[Launch]:
    """Sim workers that answer in about a millisecond, so what a router adds dominates."""
    out = []
    for i in range(WORKERS):
        port = free_port()
        args = [*WORKER_ARGS, "--model-path", str(model_dir), "--instance-id", str(i + 1)]
        command = module_command("connector.worker", port, args)
        log = log_dir / f"worker-{i + 1}.log"
        out.append(Launch(f"worker {i + 1}", command, port, log, REPO_ROOT, OFFLINE_ENV))
    return out


@dataclass
class System:
    """One way of reaching the workers: straight to one, or through a router."""

    name: str
    kind: str  # baseline | ours | peer | reference
    router: str  # memserve-router | sglang-router | smg | python floor | none
    policy: str
    cores: int | None = None  # the CPU set's size (taskset); None: not pinned
    processes: int = 1  # ours: --processes
    available: bool = True
    reason: str | None = None
    launch: Launch | None = None  # a router to start; None: the workers themselves
    server: Server | None = None  # the router, once started
    url: str = ""  # latency workloads go here
    rps_urls: list[str] = field(default_factory=list)
    # workload -> its timed requests: the i-th is the same request for every system, so each
    # pairs with the baseline's
    records: dict[str, list[Record]] = field(default_factory=dict)
    rps: dict[str, Any] | None = None

    def record(self, workload: str, request: Record) -> None:
        self.records.setdefault(workload, []).append(request)


def cpu_sets() -> list[list[int]]:
    """The last 1 and 2 (CORE_COUNTS) of the CPUs this process may use, as many as there are."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[-n:] for n in CORE_COUNTS if n <= len(cpus)]


def before_python(before: Path) -> Path:
    """`--before DIR`'s own interpreter: an editable install of ours would import ours
    whatever the working directory (and DIR's native module is built in DIR)."""
    return before / ".venv" / "bin" / "python"


def check_before(before: Path) -> None:
    """SystemExit unless `before`'s interpreter imports the router from `before`."""
    python = before_python(before)
    setup = (
        f"python -m venv --system-site-packages {before}/.venv && "
        f"{python} -m pip install --no-build-isolation --no-deps -e {before}"
    )
    if not python.is_file():
        raise SystemExit(f"--before {before}: it needs its own install ({setup})")
    where = subprocess.run(
        [str(python), "-c", "import router; print(router.__file__)"],
        cwd=before,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    if not where or Path(where).resolve().parents[1] != before.resolve():
        raise SystemExit(f"--before {before}: its python imports router from {where!r} ({setup})")


def make_systems(
    worker_urls: list[str],
    log_dir: Path,
    peers: dict[str, PeerStatus],
    before: Path | None = None,
    floor_variants: bool = True,
) -> list[System]:
    """Direct (the baseline), then on each CPU set: ours prompt_tree with one process and
    one per core, sglang-router and smg cache_aware, the Python floor; on the largest set
    also ours and sglang-router round_robin. A peer that cannot be imported is listed,
    unavailable, with the reason. `before`: an earlier commit's router beside ours, on every
    set and policy ours runs with. `floor_variants`: the floor on the other HTTP libraries
    (full runs only: they were measured to choose the server)."""
    systems = [System("direct", "baseline", "none", "-", url=worker_urls[0], rps_urls=worker_urls)]
    sets = cpu_sets()
    for cpus in sets:
        n = len(cpus)
        runs: list[tuple[str, str, int | None]] = [("ours", "prompt_tree", 1)]
        if before is not None:
            runs.append((BEFORE, "prompt_tree", 1))
        if n > 1:
            runs.append(("ours", "prompt_tree", n))
        runs += [(SGLANG_ROUTER, "cache_aware", None), (SMG, "cache_aware", None)]
        runs.append((FLOOR, "round_robin", None))
        if cpus is sets[-1]:
            runs += [("ours", "round_robin", 1), (SGLANG_ROUTER, "round_robin", None)]
            if before is not None:
                runs.append((BEFORE, "round_robin", 1))
        if cpus is sets[0] and floor_variants:
            runs += [(label, "round_robin", None) for label, _ in FLOOR_VARIANTS]
        for router, policy, procs in runs:
            # `ours prompt_tree 2p @2c`: ours with --processes 2 on 2 cores; peers have no `Np`
            name = f"{router} {policy}{'' if procs is None else f' {procs}p'} @{n}c"
            port, urls, cwd = free_port(), ["--worker-urls", *worker_urls], REPO_ROOT
            if router in ("ours", BEFORE):
                args = [*urls, "--policy", policy, "--log-level", "warning"]
                command = module_command("router", port, [*args, "--processes", str(procs)])
                kind = "ours"
                if router == BEFORE and before is not None:  # run by its own install, not ours
                    command[0], cwd, kind = str(before_python(before)), before, "reference"
            elif router.startswith(FLOOR):
                flags = dict(FLOOR_VARIANTS).get(router, [])
                command, kind = module_command(FLOOR_MODULE, port, [*urls, *flags]), "reference"
            elif peers[router].importable:
                command, kind = [*peer_command(router, policy, port, 2), *urls], "peer"
            else:
                reason = peers[router].reason
                systems.append(
                    System(name, "peer", router, policy, n, available=False, reason=reason)
                )
                continue
            tag = name.replace(" ", "-").replace("@", "").replace("[", "").replace("]", "")
            pinned = ["taskset", "-c", ",".join(map(str, cpus)), *command]
            proc = Launch(name, pinned, port, log_dir / f"{tag}.log", cwd, OFFLINE_ENV)
            router = OURS if router == "ours" else router
            system = System(name, kind, router, policy, n, procs or 1, launch=proc, url=proc.url)
            systems.append(system)
            system.rps_urls = [proc.url]
    return systems


def start_systems(systems: list[System], probe_body: bytes, timeout_s: float = 120) -> None:
    """Start every router at once; one that does not come up within `timeout_s` (all
    together) is marked unavailable (ours not coming up is an error of the project)."""
    for s in systems:
        if s.launch is not None:
            s.server = s.launch.start()
    deadline = time.monotonic() + timeout_s
    for s in systems:
        server = s.server
        if server is None:
            continue
        probe = functools.partial(http_ok, s.url + CHAT, probe_body)
        why = wait_until(server, probe, max(deadline - time.monotonic(), 1.0))
        if why is not None:
            if s.kind == "ours":
                raise RuntimeError(why)
            s.available, s.reason = False, f"failed to start: {why}"
            server.stop()
