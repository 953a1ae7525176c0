"""Clusters of our CPU workers as processes on free loopback ports, stopped by pid: one
launcher for the router's local workers (`python -m router` with no worker URLs, which
`scripts/serve.sh` runs), the tests and the benchmarks.

A `ClusterSpec` says what to start: N colocated workers, or prefill/decode pairs in one
caching mode, on the sim (the latency model) or the tiny real model, with device KV sizes, a
host tier, MemPool pulls and KV events (each worker binds an ipc:// socket: nothing listens
beyond this machine). A `Cluster` is the started workers, with what they report (their
counters, busy time, KV moved) for the benchmarks' records.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun import adapters
from localrun.processes import (
    Launch,
    Server,
    auth_headers,
    free_port,
    http_ok,
    module_command,
    start_all,
    stop_all,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Workers never download anything.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}
# Batches a worker's PUB socket queues per subscriber that does not keep up.
EVENTS_HWM = 5000


def real_model_available() -> bool:
    """The hf backend needs torch and transformers; the sim backend needs neither."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class ClusterSpec:
    """What to start: `colocated` workers, or xPyD (`prefills`, `decodes`) in `caching`."""

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
    # sim (the latency model, no tensors) | hf (the tiny model on the CPU) | auto (hf where
    # torch and transformers import); only the sim takes time scales
    backend: str = "sim"
    worker_args: tuple[str, ...] = ()  # more flags for every worker

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
    model_dir: Path | None
    events_dir: Path | None = None  # the workers' KV-event ipc sockets (None: no KV events)
    # URL -> the LoRA adapters the worker loaded at its start (none: it serves none)
    adapters_at_start: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        spec: ClusterSpec,
        model_dir: Path | None,
        log_dir: Path | None,
        max_total_tokens: int | None = None,
        first_id: int = 1,
    ) -> Cluster:
        """The workers' launches (`start` runs them). `model_dir` None: the workers' default
        model; `log_dir` None: their output goes to ours (an operator's terminal)."""
        roles = (
            ["colocated"] * spec.colocated + ["prefill"] * spec.prefills + ["decode"] * spec.decodes
        )
        backend = spec.backend
        if backend == "auto":
            backend = "hf" if real_model_available() else "sim"
        workers = []
        capacity = spec.max_total_tokens or max_total_tokens
        # A short path of its own: an ipc:// socket path must fit in 107 bytes.
        events = Path(tempfile.mkdtemp(prefix="mt-kv-")) if spec.kv_events else None
        threads = max((os.cpu_count() or 2) // max(spec.instances, 1), 1)
        for i, (role, scale) in enumerate(zip(roles, spec.scales, strict=True)):
            port = free_port()
            args = ["--backend", backend, "--instance-id", str(first_id + i)]
            if backend == "sim":
                args += ["--time-scale", f"{scale:g}"]
            else:
                args += ["--threads", str(threads)]
            if model_dir is not None:
                args += ["--model-path", str(model_dir), "--tokenizer-cache"]
            if log_dir is not None:
                args += ["--log-level", "warning"]
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
            command = module_command("connector.worker", port, [*args, *spec.worker_args])
            log = None if log_dir is None else log_dir / f"{name}.log"
            workers.append(
                Worker(Launch(name, command, port, log, REPO_ROOT, OFFLINE_ENV), role, bootstrap)
            )
        return cls(spec, workers, model_dir, events)

    def start(self, timeout_s: float = 120) -> list[str]:
        """Every worker started and healthy (RuntimeError naming the one that was not, with
        the others stopped); their URLs."""
        servers = start_all([w.launch for w in self.workers], timeout_s)
        for w, server in zip(self.workers, servers, strict=True):
            w.server = server
        for w, info in zip(self.workers, self.server_info(), strict=True):
            if adapters.registered(info):
                self.adapters_at_start[w.url] = adapters.resident(info)
        return self.urls

    def reset_adapters(self) -> int:
        """Every worker's LoRA adapters back to those it loaded at its start
        (`localrun.adapters`), the workers in parallel; the adapters reloaded."""
        if not self.adapters_at_start:
            return 0
        by_url = {w.url: info for w, info in zip(self.workers, self.server_info(), strict=True)}
        with ThreadPoolExecutor(len(self.adapters_at_start)) as pool:
            done = pool.map(
                lambda item: adapters.restore(item[0], by_url[item[0]], item[1]),
                self.adapters_at_start.items(),
            )
            return sum(done)

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

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
        (`pd_counters`), and its LoRA adapters' loads and evictions (`lora_counters`)."""
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
            out.append({**counters, **pd_counters(info), **lora_counters(info)})
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


def lora_counters(info: dict[str, Any]) -> dict[str, float]:
    """A worker's LoRA adapter loads and evictions so far (not the ones at start), from
    /get_server_info's `lora` ({} for a worker that serves no adapter)."""
    lora = info.get("lora") or {}
    if not isinstance(lora, dict) or not lora.get("adapters"):
        return {}
    return {
        "lora_loads": float(lora.get("loads") or 0),
        "lora_evictions": float(lora.get("evictions") or 0),
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


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, the labels kept verbatim, plus each metric's
    bare name holding the sum over its labelled samples (a worker splits its cached tokens
    by cache_source: the bare name is their total); {} on failure. `api_key`: a router's
    operator key, sent as a bearer token."""
    headers = {} if api_key is None else auth_headers(api_key)
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=10
        ) as resp:
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
