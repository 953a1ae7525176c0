"""The systems a benchmark compares, started in front of a cluster of workers
(`localrun.cluster`, started once and shared by every system compared on it; caches are
flushed between systems so each starts cold).

A `RouterSpec` says how to start one system: ours (`python -m router`, or replicas behind a
round-robin front: module `replicas`), sglang-router or smg. Every router of ours subscribes
to the workers' KV events where the cluster publishes them (`--kv-events-subscribe`); the
peers do not listen. Each run gets fresh router processes, so no router carries a tree over
from another run.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import OFFLINE_ENV, REPO_ROOT
from benchmarks.peers import OURS, SGLANG_ROUTER, SMG, peer_command
from localrun.cluster import Cluster, cpu_seconds, with_children
from localrun.processes import (
    Launch,
    Server,
    auth_headers,
    free_port,
    http_ok,
    module_command,
    stop_all,
    wait_until,
)
from router.policies import CostModel


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
    # ours: the operator's key (--api-key), which the benchmark's own requests (the start
    # probe, the event sync, the metrics scrape) send; its clients send their tenants' keys
    api_key: str | None = None

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


# The systems the presets compare, each preset taking its own selection.
PROMPT_TREE = RouterSpec(OURS, "prompt_tree")
COST = RouterSpec(OURS, "cost")
CACHE_AWARE = RouterSpec(SGLANG_ROUTER, "cache_aware")
ROUND_ROBIN = RouterSpec(SGLANG_ROUTER, "round_robin")
SMG_CACHE_AWARE = RouterSpec(SMG, "cache_aware")
# PD: sglang-router and smg choose the prefill and the decode apart.
PD_CACHE_AWARE = RouterSpec(SGLANG_ROUTER, "cache_aware", True, 1, "cache_aware", "power_of_two")
PD_ROUND_ROBIN = RouterSpec(SGLANG_ROUTER, "round_robin", True, 1, "round_robin", "round_robin")
PD_SMG = RouterSpec(SMG, "cache_aware", True, 1, "cache_aware", "power_of_two")


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
        "--lora-load-secs": cost.lora_load_s,
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
        if spec.api_key:
            args += ["--api-key", spec.api_key]
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


def chat_probe(url: str, model: str, api_key: str | None = None) -> Callable[[], bool]:
    """A tiny chat request through `url` answers 200: the system routes."""
    probe = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    ).encode()
    return functools.partial(
        http_ok, url + "/v1/chat/completions", probe, timeout=10, api_key=api_key
    )


def start_router(
    spec: RouterSpec,
    cluster: Cluster,
    log_dir: Path,
    model: str,
    timeout_s: float = 90,
    probe: Callable[[str], Callable[[], bool]] | None = None,
    tag: str | None = None,
) -> RunningRouter:
    """Start one router and wait until a tiny chat request (or `probe(url)`) goes through
    it; RuntimeError (with the log's tail) when it does not come up. `tag` names its log."""
    port = free_port()
    log = log_dir / f"{cluster.spec.name}-{slug(tag or spec.name)}.log"
    server = launch(spec.name, router_args(spec, cluster, port), port, log).start()
    ready = probe(server.url) if probe else chat_probe(server.url, model, spec.api_key)
    why = wait_until(server, ready, timeout_s)
    if why is not None:
        server.stop()
        raise RuntimeError(why)
    return RunningRouter(spec, server)


def sync_events(
    router_urls: Sequence[str], cluster: Cluster, timeout_s: float = 20, api_key: str | None = None
) -> bool:
    """Our routers have just subscribed: let what they replay from the workers' buffers
    (events of earlier runs) drain in, then flush every cache and wait until each worker's
    clear event has reached every router, so the trees start as empty as the caches. False
    when that did not happen in time (the run goes on; the record says so). `api_key`: the
    routers' operator key."""
    headers = {} if api_key is None else auth_headers(api_key)

    def batches(url: str) -> int:
        request = urllib.request.Request(url + "/get_server_info", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
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
