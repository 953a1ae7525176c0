"""Workers and routers as subprocesses on free loopback ports, stopped by pid.

A `Cluster` is one set of sim workers (N colocated, or prefill/decode pairs in one caching
mode) started once and shared by every system compared on it; caches are flushed between
systems so each starts cold. A `RouterSpec` says how to start one system in front of a
cluster: ours (`python -m router`), sglang-router or smg; each run gets a fresh router
process, so no router carries a tree over from another run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.router_overhead import Proc, free_port, http_ok, wait_until

OURS = "memserve-router"
SGLANG_ROUTER = "sglang-router"
SMG = "smg"
PEER_MODULES = {SGLANG_ROUTER: "sglang_router", SMG: "smg"}


@dataclass
class ClusterSpec:
    """What to start: `colocated` workers, or `pairs` xPyD (prefills, decodes) in `caching`."""

    name: str
    colocated: int = 0
    prefills: int = 0
    decodes: int = 0
    caching: str | None = None  # PD: basic | caching-1 | caching-2 | caching-3
    radix_cache: bool = True
    label: str = ""  # MemServe's name for it: PD, PD-CC, 1P1D, 1P1D-CC
    time_scale: float = 1.0  # the sim's --time-scale: >1 is a slower GPU (more load per rate)

    @property
    def pd(self) -> bool:
        return self.prefills > 0

    @property
    def instances(self) -> int:
        return self.colocated + self.prefills + self.decodes


@dataclass
class Worker:
    proc: Proc
    role: str  # colocated | prefill | decode
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return self.proc.url


@dataclass
class Cluster:
    spec: ClusterSpec
    workers: list[Worker]
    model_dir: Path

    @classmethod
    def create(
        cls,
        spec: ClusterSpec,
        model_dir: Path,
        log_dir: Path,
        max_total_tokens: int | None,
        first_id: int = 1,
    ) -> Cluster:
        roles = (
            ["colocated"] * spec.colocated + ["prefill"] * spec.prefills + ["decode"] * spec.decodes
        )
        workers = []
        for i, role in enumerate(roles):
            port = free_port()
            args = [sys.executable, "-m", "connector.worker", "--backend", "sim"]
            args += ["--time-scale", f"{spec.time_scale:g}", "--model-path", str(model_dir)]
            args += ["--host", "127.0.0.1", "--port", str(port), "--tokenizer-cache"]
            args += ["--instance-id", str(first_id + i), "--log-level", "warning"]
            if max_total_tokens:
                args += ["--max-total-tokens", str(max_total_tokens)]
            if not spec.radix_cache:
                args.append("--disable-radix-cache")
            bootstrap = None
            if role != "colocated":
                args += ["--disaggregation-mode", role, "--pd-caching", spec.caching or "basic"]
                if role == "prefill":
                    bootstrap = free_port()
                    args += ["--disaggregation-bootstrap-port", str(bootstrap)]
            name = f"{spec.name}-{role}-{i}"
            workers.append(Worker(Proc(name, args, port, log_dir / f"{name}.log"), role, bootstrap))
        return cls(spec, workers, model_dir)

    def start(self, timeout_s: float = 120) -> None:
        for w in self.workers:
            w.proc.start()
        for w in self.workers:
            why = wait_until(w.proc, lambda w=w: http_ok(w.url + "/health"), timeout_s)
            if why is not None:
                raise RuntimeError(why)

    def stop(self) -> None:
        for w in self.workers:
            w.proc.stop()

    @property
    def time_scale(self) -> float:
        return self.spec.time_scale

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def flush(self, timeout_s: float = 60) -> None:
        """Empty every worker's cache; waits while a worker still has requests running."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            while not http_ok(w.url + "/flush_cache", b""):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{w.proc.name} would not flush its cache")
                time.sleep(0.2)

    def server_info(self) -> list[dict[str, Any]]:
        out = []
        for w in self.workers:
            try:
                with urllib.request.urlopen(w.url + "/get_server_info", timeout=10) as resp:
                    out.append(json.load(resp))
            except (OSError, ValueError):
                out.append({})
        return out

    def worker_counters(self) -> list[dict[str, float]]:
        """Per worker: requests, prompt and cached tokens so far (its Prometheus counters)."""
        names = {
            "sglang:num_requests_total": "requests",
            "sglang:prompt_tokens_total": "prompt_tokens",
            "sglang:cached_tokens_total": "cached_tokens",
            "memserve:evicted_blocks_total": "evicted_blocks",
        }
        out = []
        for w in self.workers:
            metrics = scrape(w.url + "/metrics")
            out.append({short: metrics.get(name, 0.0) for name, short in names.items()})
        return out

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(w.proc.proc.pid if w.proc.proc else None) for w in self.workers)

    def busy_seconds(self) -> list[float]:
        """Per worker: modelled GPU seconds so far (the sim's busy time, unscaled)."""
        return [
            float((info.get("backend") or {}).get("simulated_busy_s") or 0.0)
            for info in self.server_info()
        ]

    def kv_moved(self) -> tuple[int, int]:
        """(pages, modelled bytes) moved between instances so far (PD transfers and
        write-backs, as the senders count them)."""
        pages = 0
        nbytes = 0
        for info in self.server_info():
            pd = info.get("disaggregation") or {}
            page_bytes = (info.get("backend") or {}).get("modelled_kv_page_bytes") or 0
            moved = int(pd.get("pages_moved") or 0)
            pages += moved
            nbytes += moved * int(page_bytes)
        return pages, nbytes

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "label": self.spec.label,
            "instances": self.spec.instances,
            "colocated": self.spec.colocated,
            "prefills": self.spec.prefills,
            "decodes": self.spec.decodes,
            "pd_caching": self.spec.caching,
            "radix_cache": self.spec.radix_cache,
            "time_scale": self.spec.time_scale,
        }


# --------------------------------------------------------------------------- routers


@dataclass(frozen=True)
class RouterSpec:
    """One system: a router implementation and its policy."""

    router: str  # memserve-router | sglang-router | smg
    policy: str

    @property
    def name(self) -> str:
        return f"{'ours' if self.router == OURS else self.router} {self.policy}"


@dataclass
class PeerStatus:
    importable: bool
    version: str | None
    reason: str | None


def peer_status(package: str) -> PeerStatus:
    module = PEER_MODULES[package]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return PeerStatus(False, None, f"{module} is not importable (pip install {package})")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return PeerStatus(True, version, None)


@dataclass
class RunningRouter:
    spec: RouterSpec
    proc: Proc
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.proc.url


def router_args(spec: RouterSpec, cluster: Cluster, port: int) -> list[str]:
    colocated = [w.url for w in cluster.by_role("colocated")]
    prefills = cluster.by_role("prefill")
    decodes = cluster.by_role("decode")
    if spec.router == OURS:
        args = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--policy", spec.policy, "--log-level", "warning"]
        args += ["--tokenizer-path", str(cluster.model_dir)]
        if cluster.spec.pd:
            for w in prefills:
                args += ["--prefill", w.url, str(w.bootstrap_port)]
            for w in decodes:
                args += ["--decode", w.url]
            args += ["--pd-caching", cluster.spec.caching or "basic"]
        else:
            args += ["--worker-urls", *colocated]
        return args
    module = PEER_MODULES[spec.router]
    args = [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--policy", spec.policy, "--log-level", "warn"]
    args += ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]
    args += ["--shutdown-grace-period-secs", "1"]
    if spec.router == SMG:
        args.append("--disable-tokenizer-autoload")  # else it fetches a tokenizer online
    if cluster.spec.pd:
        args.append("--pd-disaggregation")
        for w in prefills:
            args += ["--prefill", w.url, str(w.bootstrap_port)]
        for w in decodes:
            args += ["--decode", w.url]
    else:
        args += ["--worker-urls", *colocated]
    return args


def start_router(
    spec: RouterSpec, cluster: Cluster, log_dir: Path, model: str, timeout_s: float = 90
) -> RunningRouter:
    """Start one router and wait until a tiny chat request goes through it; RuntimeError
    (with the log's tail) when it does not come up."""
    port = free_port()
    slug = spec.name.replace(" ", "-")
    proc = Proc(
        spec.name,
        router_args(spec, cluster, port),
        port,
        log_dir / f"{cluster.spec.name}-{slug}.log",
    )
    proc.start()
    probe = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    ).encode()
    why = wait_until(
        proc, lambda: http_ok(proc.url + "/v1/chat/completions", probe, timeout=10), timeout_s
    )
    if why is not None:
        proc.stop()
        raise RuntimeError(why)
    return RunningRouter(spec, proc)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds a process has used so far (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, the labels kept verbatim; {} on failure."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.split("{model_name=")[0]] = float(value)
        except ValueError:
            continue
    return out


def model_name(url: str) -> str:
    """The served model id, which the peers require in every body."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]
