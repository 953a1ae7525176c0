"""The processes: two sim workers, and in front of the very same workers each system compared
(ours with two policies, sglang-router with two), every one on a free loopback port."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import OFFLINE_ENV, REPO_ROOT
from benchmarks.peers import OURS, SGLANG_ROUTER, PeerStatus, peer_command
from benchmarks.router_overhead.settings import CHAT
from router.procs import Launch, Server, free_port, http_ok, module_command, stop_all, wait_until

WORKERS = 2
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
    kind: str  # baseline | ours | peer
    router: str  # memserve-router | sglang-router | none
    policy: str
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

    def record(self, workload: str, seconds: float | None, usage: dict[str, Any] | None) -> None:
        self.samples.setdefault(workload, []).append(seconds)
        if seconds is None:
            self.errors[workload] = self.errors.get(workload, 0) + 1
            return
        if usage:
            prompt = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
            self.prompt_tokens.setdefault(workload, []).append(prompt)
            if prompt:
                self.cached.setdefault(workload, []).append(cached / prompt)


def make_systems(worker_urls: list[str], log_dir: Path, peer: PeerStatus) -> list[System]:
    """Direct (the baseline), ours prompt_tree and round_robin, sglang-router cache_aware and
    round_robin (unavailable, with the reason, when it cannot be imported)."""
    urls = worker_urls
    systems = [System("direct", "baseline", "none", "-", url=urls[0], rps_urls=urls)]
    for policy in ("prompt_tree", "round_robin"):
        port = free_port()
        args = ["--worker-urls", *urls, "--policy", policy, "--log-level", "warning"]
        command = module_command("router", port, args)
        proc = launch(f"ours {policy}", command, port, log_dir / f"ours-{policy}.log")
        systems.append(System(f"ours {policy}", "ours", OURS, policy, launch=proc))
    for policy in ("cache_aware", "round_robin"):
        name = f"{SGLANG_ROUTER} {policy}"
        system = System(name, "peer", SGLANG_ROUTER, policy)
        if peer.importable:
            port = free_port()
            command = [*peer_command(SGLANG_ROUTER, policy, port, 2), "--worker-urls", *urls]
            system.launch = launch(name, command, port, log_dir / f"peer-{policy}.log")
        else:
            system.available, system.reason = False, peer.reason
        systems.append(system)
    for s in systems:
        if s.launch is not None:
            s.url = s.launch.url
            s.rps_urls = [s.launch.url]
    return systems


def start_systems(systems: list[System], probe_body: bytes, timeout_s: float = 120) -> None:
    """Start every router at once; one that does not come up is marked unavailable (ours
    not coming up is an error of the project)."""
    for s in systems:
        if s.launch is not None:
            s.server = s.launch.start()
    for s in systems:
        server = s.server
        if server is None:
            continue
        probe = functools.partial(http_ok, s.url + CHAT, probe_body)
        why = wait_until(server, probe, timeout_s)
        if why is not None:
            if s.kind == "ours":
                raise RuntimeError(why)
            s.available, s.reason = False, f"failed to start: {why}"
            server.stop()


def stop_systems(systems: list[System], workers: list[Server]) -> None:
    """Routers and workers all at once, each by its pid."""
    stop_all([s.server for s in systems if s.server is not None] + workers)
