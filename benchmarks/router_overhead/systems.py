"""The processes: two sim workers, and in front of the very same workers each system compared,
every one on a free loopback port.

Each router runs on a CPU set (taskset) of 1 and of 2 cores (as many as this machine lets
the benchmark use): ours with one process and with a process per core (`--processes`),
sglang-router and smg with cache_aware (their runtimes use every core they may); on the
largest set also ours and sglang-router with round_robin, the bare proxy hop. On each set
also the Python floor (`floor_proxy`): the least a Python router can do per request, a
reference for what no work on ours can go below. The workers and the client are not pinned.
"""

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
    stop_all,
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


def launch(name: str, args: list[str], port: int, log: Path) -> Launch:
    """A benchmark process: run from the repository root, offline, its output in `log`."""
    return Launch(name, args, port, log, REPO_ROOT, OFFLINE_ENV)


def worker_launches(model_dir: Path, log_dir: Path) -> list[Launch]:
    """Sim workers that answer in about a millisecond, so what a router adds dominates."""
    out = []
    for i in range(WORKERS):
        port = free_port()
        args = [*WORKER_ARGS, "--model-path", str(model_dir), "--instance-id", str(i + 1)]
        command = module_command("connector.worker", port, args)
        out.append(launch(f"worker {i + 1}", command, port, log_dir / f"worker-{i + 1}.log"))
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
    # workload -> seconds per request, None for a failed one: the i-th request is the same
    # request for every system, so samples pair with the baseline's
    samples: dict[str, list[float | None]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    cached: dict[str, list[float]] = field(default_factory=dict)  # workload -> cached fraction
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)
    rps: dict[str, Any] | None = None

    def record(self, workload: str, request: Record) -> None:
        """One timed request: its seconds (None: an error) and its cached share."""
        self.samples.setdefault(workload, []).append(request.e2e_s if request.ok else None)
        if not request.ok:
            self.errors[workload] = self.errors.get(workload, 0) + 1
            return
        prompt = request.prompt_tokens
        self.prompt_tokens.setdefault(workload, []).append(prompt)
        if prompt:
            self.cached.setdefault(workload, []).append(request.cached_tokens / prompt)


def cpu_sets() -> list[list[int]]:
    """The CPU sets the routers run on: the last 1 and 2 (CORE_COUNTS) of the CPUs this
    process may use, as many as there are."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[-n:] for n in CORE_COUNTS if n <= len(cpus)]


def system_name(router: str, policy: str, cores: int, processes: int | None = None) -> str:
    """`ours prompt_tree 2p @2c`: ours with --processes 2 on 2 cores; peers have no `Np`."""
    procs = "" if processes is None else f" {processes}p"
    return f"{router} {policy}{procs} @{cores}c"


def before_python(before: Path) -> Path:
    """The interpreter of `--before DIR`'s own install (DIR/.venv): an editable install maps
    the package names to the checkout it was installed from, whatever the working directory,
    so ours would answer in its place (and its native module is built there)."""
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
    with one per core, sglang-router and smg cache_aware, the Python floor; on the largest
    set also ours and sglang-router round_robin (a peer that cannot be imported is listed,
    unavailable, with the reason). With `before` (a checkout of an earlier commit), also
    that commit's router, one process, on every set and policy ours runs with: a
    before/after comparison in one run. `floor_variants`: the floor on the other HTTP
    libraries too (full runs only: they were measured to choose the server)."""
    urls = worker_urls
    systems = [System("direct", "baseline", "none", "-", url=urls[0], rps_urls=urls)]
    sets = cpu_sets()
    for cpus in sets:
        n = len(cpus)
        pin = ["taskset", "-c", ",".join(map(str, cpus))]
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
            name = system_name(router, policy, n, procs)
            tag = name.replace(" ", "-").replace("@", "").replace("[", "").replace("]", "")
            port = free_port()
            if router in ("ours", BEFORE):
                args = ["--worker-urls", *urls, "--policy", policy, "--log-level", "warning"]
                command = module_command("router", port, [*args, "--processes", str(procs)])
                log = log_dir / f"{tag}.log"
                if router == BEFORE and before is not None:
                    command[0] = str(before_python(before))  # its own install, not ours
                    proc = Launch(name, [*pin, *command], port, log, before, OFFLINE_ENV)
                    system = System(name, "reference", router, policy, n, launch=proc)
                else:
                    proc = launch(name, [*pin, *command], port, log)
                    system = System(name, "ours", OURS, policy, n, procs or 1, launch=proc)
            elif router.startswith(FLOOR):
                flags = dict(FLOOR_VARIANTS).get(router, [])
                command = module_command(FLOOR_MODULE, port, ["--worker-urls", *urls, *flags])
                proc = launch(name, [*pin, *command], port, log_dir / f"{tag}.log")
                system = System(name, "reference", router, policy, n, launch=proc)
            else:
                system = System(name, "peer", router, policy, n)
                if peers[router].importable:
                    command = [*peer_command(router, policy, port, 2), "--worker-urls", *urls]
                    system.launch = launch(name, [*pin, *command], port, log_dir / f"{tag}.log")
                else:
                    system.available, system.reason = False, peers[router].reason
            systems.append(system)
    for s in systems:
        if s.launch is not None:
            s.url = s.launch.url
            s.rps_urls = [s.launch.url]
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


def stop_systems(systems: list[System], workers: list[Server]) -> None:
    """Routers and workers all at once, each by its pid."""
    stop_all([s.server for s in systems if s.server is not None] + workers)
