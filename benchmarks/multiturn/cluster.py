"""Workers and routers as subprocesses on free loopback ports, stopped by pid.

A `Cluster` is one set of sim workers (N colocated, or prefill/decode pairs in one caching
mode) started once and shared by every system compared on it; caches are flushed between
systems so each starts cold. A cluster may size its device KV, add a host tier, let its
workers pull prefixes from each other (MemPool) and publish KV events: each worker binds an
ipc:// socket (nothing listens beyond this machine) and every router of ours in front of it
subscribes (`--kv-events-subscribe`), one router or several replicas alike; the peers do not
listen. A `RouterSpec` says how to start one system in front of a cluster: ours (`python -m
router`, or replicas behind a round-robin front: module `replicas`), sglang-router or smg;
each run gets fresh router processes, so no router carries a tree over from another run.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import OFFLINE_ENV, REPO_ROOT
from benchmarks.peers import OURS, peer_command
from localrun.processes import (
    Launch,
    Server,
    free_port,
    http_ok,
    module_command,
    start_all,
    stop_all,
    wait_until,
)
from router.policies import CostModel


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
    # Per worker (in role order: colocated, prefills, decodes), a mixed cluster's engines;
    # () gives every worker `time_scale`. `time_scale` is then the speed our router's cost
    # model is told (`scaled_cost_args`); it learns how much slower each other worker is.
    time_scales: tuple[float, ...] = ()
    max_total_tokens: int | None = None  # device KV per worker (None: the plan's, or the sim's)
    hicache_ratio: float = 0.0  # > 0: a host tier of this many times the device KV
    mempool_pull: bool = False  # colocated workers and prefills pull longer prefixes from peers
    kv_events: bool = False  # workers publish KV events (bound ipc sockets) to our routers

    @property
    def pd(self) -> bool:
        return self.prefills > 0

    @property
    def instances(self) -> int:
        return self.colocated + self.prefills + self.decodes

    @property
    def scales(self) -> list[float]:
        """Each worker's time scale, in role order. ValueError when `time_scales` does not
        name one per worker."""
        if not self.time_scales:
            return [self.time_scale] * self.instances
        if len(self.time_scales) != self.instances:
            raise ValueError(
                f"{self.name}: {len(self.time_scales)} time scales for {self.instances} workers"
            )
        return list(self.time_scales)


@dataclass
class Worker:
    launch: Launch
    role: str  # colocated | prefill | decode
    bootstrap_port: int | None = None
    server: Server | None = None  # once started

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def pid(self) -> int | None:
        return None if self.server is None else self.server.proc.pid


@dataclass
class Cluster:
    spec: ClusterSpec
    workers: list[Worker]
    model_dir: Path
    events_dir: Path | None = None  # the workers' KV-event ipc sockets (None: no KV events)

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
        capacity = spec.max_total_tokens or max_total_tokens
        # A short path of its own: an ipc:// socket path must fit in 107 bytes.
        events = Path(tempfile.mkdtemp(prefix="mt-kv-")) if spec.kv_events else None
        for i, (role, scale) in enumerate(zip(roles, spec.scales, strict=True)):
            port = free_port()
            args = ["--backend", "sim", "--time-scale", f"{scale:g}"]
            args += ["--model-path", str(model_dir), "--tokenizer-cache"]
            args += ["--instance-id", str(first_id + i), "--log-level", "warning"]
            if capacity:
                args += ["--max-total-tokens", str(capacity)]
            if not spec.radix_cache:
                args.append("--disable-radix-cache")
            if spec.hicache_ratio > 0:
                args += [
                    "--enable-hierarchical-cache",
                    "--hicache-ratio",
                    f"{spec.hicache_ratio:g}",
                ]
            if spec.mempool_pull and role != "decode":  # a PD decode does not pull
                args.append("--enable-mempool-pull")
            if events is not None:
                config = {
                    "publisher": "zmq",
                    "endpoint": f"ipc://{events}/kv-{port}.sock",
                    "replay_endpoint": f"ipc://{events}/kv-{port}-replay.sock",
                    "hwm": EVENTS_HWM,
                }
                args += ["--kv-events-config", json.dumps(config)]
            bootstrap = None
            if role != "colocated":
                args += ["--disaggregation-mode", role, "--pd-caching", spec.caching or "basic"]
                if role == "prefill":
                    bootstrap = free_port()
                    args += ["--disaggregation-bootstrap-port", str(bootstrap)]
            name = f"{spec.name}-{role}-{i}"
            command = module_command("connector.worker", port, args)
            proc = launch(name, command, port, log_dir / f"{name}.log")
            workers.append(Worker(proc, role, bootstrap))
        return cls(spec, workers, model_dir, events)

    def start(self, timeout_s: float = 120) -> None:
        servers = start_all([w.launch for w in self.workers], timeout_s)
        for w, server in zip(self.workers, servers, strict=True):
            w.server = server

    def stop(self) -> None:
        stop_all([w.server for w in self.workers if w.server is not None])
        if self.events_dir is not None:
            shutil.rmtree(self.events_dir, ignore_errors=True)

    @property
    def kv_events(self) -> bool:
        return self.events_dir is not None

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
                    raise RuntimeError(f"{w.name} would not flush its cache")
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
        """Per worker: requests, prompt and cached tokens, evictions, retractions and aborts
        so far (its Prometheus counters), and what it sent to other PD instances
        (`pd_counters`)."""
        names = {
            "sglang:num_requests_total": "requests",
            "sglang:prompt_tokens_total": "prompt_tokens",
            "sglang:cached_tokens_total": "cached_tokens",
            "memserve:evicted_blocks_total": "evicted_blocks",
            "sglang:num_retracted_requests_total": "retracted",
            "sglang:num_aborted_requests_total": "aborted",
        }
        out = []
        for w, info in zip(self.workers, self.server_info(), strict=True):
            metrics = scrape(w.url + "/metrics")
            counters = {short: metrics.get(name, 0.0) for name, short in names.items()}
            out.append({**counters, **pd_counters(info)})
        return out

    def tier_counters(self) -> dict[str, float]:
        """Summed over the workers, so far: pulls and pulled tokens, the tiers' hit tokens,
        swaps and drops, and the modelled bytes of KV pulled (from /get_server_info)."""
        out: dict[str, float] = {}
        for info in self.server_info():
            pull = info.get("pull") or {}
            tiers = info.get("kv_tiers") or {}
            page_bytes = (info.get("backend") or {}).get("modelled_kv_page_bytes") or 0
            token_bytes = page_bytes / (info.get("page_size") or 16)
            values = {f"pull_{k}": v for k, v in pull.items()}
            for tier, figures in tiers.items():
                values.update({f"{tier}_{k}": v for k, v in (figures or {}).items()})
            values["pulled_bytes"] = float(pull.get("pulled_tokens") or 0) * token_bytes
            for key, value in values.items():
                if isinstance(value, int | float) and not key.endswith("capacity_tokens"):
                    out[key] = out.get(key, 0.0) + float(value)
        return out

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(w.pid) for w in self.workers)

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
            "time_scales": self.spec.scales,
        }


# --------------------------------------------------------------------------- routers


@dataclass(frozen=True)
class RouterSpec:
    """One system: a router implementation and its policy (ours: with or without pulls, one
    router or `replicas` sharing state through Redis behind a round-robin front)."""

    router: str  # memserve-router | sglang-router | smg
    policy: str
    pull: bool = True  # ours: plan MemPool pulls (False: --disable-mempool-pull)
    replicas: int = 1  # ours: > 1 runs that many replicas, a redis-server and the front
    prefill_policy: str | None = None  # PD: --prefill-policy (None: the router's default)
    decode_policy: str | None = None  # PD: --decode-policy
    processes: int = 1  # ours: --processes (one router of that many processes, one port)
    args: tuple[str, ...] = ()  # ours: more flags (admission, the cost model's terms)
    tag: str = ""  # ours: what `args` changes, for the name ("" when nothing)

    @property
    def name(self) -> str:
        name = f"{'ours' if self.router == OURS else self.router} {self.policy}"
        if self.prefill_policy or self.decode_policy:
            name = (
                f"{'ours' if self.router == OURS else self.router} PD "
                f"{self.prefill_policy or self.policy}/{self.decode_policy or self.policy}"
            )
        if self.replicas > 1:
            name += f" x{self.replicas} replicas"
        if self.processes > 1:
            name += f" x{self.processes} processes"
        if self.tag:
            name += f" {self.tag}"
        return name if self.pull else f"{name} (no pull)"


@dataclass
class RunningRouter:
    """A started system: `server` takes the clients' requests (a router, or the front of
    replicas); `replicas` are our routers behind it (for their metrics and KV-event sync);
    `helpers` the rest it runs (redis-server). All are stopped together, by pid."""

    spec: RouterSpec
    server: Server
    replicas: list[Server] = field(default_factory=list)
    helpers: list[Server] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # for the run's record

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def routers(self) -> list[Server]:
        """Our routers: the replicas, or the one router (none for a peer)."""
        if self.replicas:
            return self.replicas
        return [self.server] if self.spec.router == OURS else []

    def processes(self) -> list[Server]:
        return [self.server, *self.replicas, *self.helpers]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far per part: the routers, and the front and helpers if any."""
        routers = self.routers or [self.server]
        out = {"router": sum(cpu_seconds(p) for s in routers for p in with_children(s.proc.pid))}
        if self.replicas:
            out["front"] = cpu_seconds(self.server.proc.pid)
        for helper in self.helpers:
            out[helper.name] = cpu_seconds(helper.proc.pid)
        return out

    def stop(self) -> None:
        """The front and routers first, then the helpers (redis outlives its clients, which
        would otherwise log it as lost on their way out)."""
        stop_all([self.server, *self.replicas])
        stop_all(self.helpers)


def launch(name: str, args: list[str], port: int, log: Path) -> Launch:
    """A benchmark process: run from the repository root, offline, its output in `log`."""
    return Launch(name, args, port, log, REPO_ROOT, OFFLINE_ENV)


def scaled_cost_args(time_scale: float) -> list[str]:
    """Our router's cost-model flags for sim workers slowed `time_scale` times: its defaults
    (the sim's H100) times the scale, so that modelled work and the queues it measures in
    real seconds are in the same units, as an operator sets them to their real GPU."""
    if time_scale in (0, 1):
        return []
    cost = CostModel()
    terms = {
        "--prefill-secs-per-token": cost.prefill_s_per_token,
        "--prefill-secs-per-token-pair": cost.prefill_s_per_token_pair,
        "--transfer-secs-per-token": cost.transfer_s_per_token,
        "--host-load-secs-per-token": cost.host_load_s_per_token,
        "--busy-secs-per-request": cost.busy_s_per_request,
    }
    return [x for flag, value in terms.items() for x in (flag, f"{value * time_scale:.6g}")]


def router_args(spec: RouterSpec, cluster: Cluster, port: int) -> list[str]:
    colocated = [w.url for w in cluster.by_role("colocated")]
    prefills = cluster.by_role("prefill")
    decodes = cluster.by_role("decode")
    if spec.router == OURS:
        args = ["--policy", spec.policy, "--log-level", "warning"]
        args += ["--tokenizer-path", str(cluster.model_dir)]
        if cluster.spec.pd:
            for w in prefills:
                args += ["--prefill", w.url, str(w.bootstrap_port)]
            for w in decodes:
                args += ["--decode", w.url]
            args += ["--pd-caching", cluster.spec.caching or "basic"]
        else:
            args += ["--worker-urls", *colocated]
        if cluster.kv_events:
            args.append("--kv-events-subscribe")
        if not spec.pull:
            args.append("--disable-mempool-pull")
        args += ["--processes", str(spec.processes)]
        args += scaled_cost_args(cluster.time_scale)
        args += spec.args  # (after the scaled terms: a spec's own cost flags win)
        return module_command("router", port, args + pd_policies(spec, cluster))
    args = peer_command(spec.router, spec.policy, port, grace_s=1)
    if cluster.spec.pd:
        args.append("--pd-disaggregation")
        for w in prefills:
            args += ["--prefill", w.url, str(w.bootstrap_port)]
        for w in decodes:
            args += ["--decode", w.url]
    else:
        args += ["--worker-urls", *colocated]
    return args + pd_policies(spec, cluster)


def pd_policies(spec: RouterSpec, cluster: Cluster) -> list[str]:
    """`--prefill-policy` / `--decode-policy` of a PD system (the same flags in all three
    routers); none on a colocated cluster."""
    if not cluster.spec.pd:
        return []
    args = []
    if spec.prefill_policy:
        args += ["--prefill-policy", spec.prefill_policy]
    if spec.decode_policy:
        args += ["--decode-policy", spec.decode_policy]
    return args


def slug(name: str) -> str:
    """A system's name as a file name."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in name)


def chat_probe(url: str, model: str) -> Callable[[], bool]:
    """A tiny chat request through `url` answers 200: the system routes."""
    probe = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    ).encode()
    return functools.partial(http_ok, url + "/v1/chat/completions", probe, timeout=10)


def start_router(
    spec: RouterSpec, cluster: Cluster, log_dir: Path, model: str, timeout_s: float = 90
) -> RunningRouter:
    """Start one router and wait until a tiny chat request goes through it; RuntimeError
    (with the log's tail) when it does not come up."""
    port = free_port()
    log = log_dir / f"{cluster.spec.name}-{slug(spec.name)}.log"
    server = launch(spec.name, router_args(spec, cluster, port), port, log).start()
    why = wait_until(server, chat_probe(server.url, model), timeout_s)
    if why is not None:
        server.stop()
        raise RuntimeError(why)
    return RunningRouter(spec, server)


# Batches a worker's PUB socket queues per subscriber that does not keep up.
EVENTS_HWM = 5000


def sync_events(router_urls: Sequence[str], cluster: Cluster, timeout_s: float = 20) -> bool:
    """Our routers have just subscribed: let what they replay from the workers' buffers
    (events of earlier runs) drain in, then flush every cache and wait until each worker's
    clear event has reached every router, so the trees start as empty as the caches. False
    when that did not happen in time (the run goes on; the record says so)."""

    def batches(url: str) -> int:
        try:
            with urllib.request.urlopen(url + "/get_server_info", timeout=5) as resp:
                return int((json.load(resp).get("kv_events") or {}).get("batches") or 0)
        except (OSError, ValueError):
            return -1

    def counts() -> list[int]:
        return [batches(url) for url in router_urls]

    deadline = time.monotonic() + timeout_s
    last, stable_since = counts(), time.monotonic()
    while time.monotonic() - stable_since < 0.5 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = counts()
        if now != last:
            last, stable_since = now, time.monotonic()
    cluster.flush()
    want = [n + len(cluster.workers) for n in last]
    while time.monotonic() < deadline:
        if all(n >= w for n, w in zip(counts(), want, strict=True)):
            return True
        time.sleep(0.05)
    return False


def with_children(pid: int) -> list[int]:
    """A process and its children (a router of several processes is a supervisor and them)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return [pid, *map(int, children)]


def pd_counters(info: dict[str, Any]) -> dict[str, float]:
    """A PD worker's transfers so far, from /get_server_info: KV pushes it sent (a prefill's
    to its decodes; a decode's are write-backs to the prefill, PD-Caching-3), pages and
    modelled bytes it sent, and write-backs completed ({} for a colocated worker)."""
    pd = info.get("disaggregation") or {}
    if not pd:
        return {}
    page_bytes = float((info.get("backend") or {}).get("modelled_kv_page_bytes") or 0)
    pages = float(pd.get("pages_moved") or 0)
    return {
        "pd_pushes": float(pd.get("sent") or 0),
        "pd_pages_sent": pages,
        "pd_bytes_sent": pages * page_bytes,
        "written_back": float(pd.get("written_back") or 0),
    }


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
    """Prometheus text as {name{labels}: value}, the labels kept verbatim, plus each metric's
    bare name holding the sum over its labelled samples (a worker splits its cached tokens
    by cache_source: the bare name is their total); {} on failure."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = number
        if "{" in name:
            bare = name.split("{", 1)[0]
            totals[bare] = totals.get(bare, 0.0) + number
    for bare, total in totals.items():
        out.setdefault(bare, total)
    return out
