"""Executes a plan: clusters up one at a time, each step's systems in turn, results per run."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.progress import Progress, TaskID

from benchmarks.harness import progress_bar, run_async
from benchmarks.harness import step as advance
from benchmarks.load.bodies import served_model
from benchmarks.load.causal import run_workload
from benchmarks.load.record import Record
from benchmarks.multiturn.adapter_floor import RunAdapters
from benchmarks.multiturn.cluster import RouterSpec, start_router, sync_events
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.metrics import active_span, summarize
from benchmarks.multiturn.oracle import LruCaches, replay
from benchmarks.multiturn.per_tenant import fairness, per_tenant
from benchmarks.multiturn.plan import Plan, Step
from benchmarks.multiturn.queue_floor import (
    PREFILL_ROLES,
    lru_reference,
    prefill_servers,
    queued_floor_stats,
)
from benchmarks.multiturn.replicas import propagation, replica_metrics, start_replicated
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import Workload
from benchmarks.peers import OURS, SGLANG_ROUTER, SMG, PeerStatus, peer_status
from localrun.cluster import Cluster, scrape


@dataclass
class Context:
    """What every run of a plan shares: the model's tokenizer (the oracle's encodes), the
    workloads' vocabulary, the peers' status, the progress bars, the log directory; and the
    plan being run (`context`)."""

    model_dir: Path
    tokenizer: Any  # ChatTokenizer
    encoder: Any  # CachedEncoder: the oracle's chat encodes
    vocab: Vocab
    peers: dict[str, PeerStatus]
    progress: Progress
    log_dir: Path
    plan: Plan = field(default_factory=lambda: Plan("", {}, [], None))

    @classmethod
    @contextmanager
    def open(cls, log_dir: Path | None) -> Iterator[Context]:
        from connector.model_files import ensure_hf_model
        from shared.token_cache import CachedEncoder
        from shared.tokenizer import ChatTokenizer

        model_dir = ensure_hf_model()
        tokenizer = ChatTokenizer(model_dir)
        peers = {p: peer_status(p) for p in (SGLANG_ROUTER, SMG)}
        with (
            tempfile.TemporaryDirectory(prefix="multiturn-") as tmp,
            progress_bar(46) as progress,
        ):
            logs = log_dir or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            encoder, vocab = CachedEncoder(tokenizer), Vocab.from_tokenizer(tokenizer)
            yield cls(model_dir, tokenizer, encoder, vocab, peers, progress, logs)

    def context(self, plan: Plan) -> Context:
        """This session running `plan`."""
        return replace(self, plan=plan)


# Called once per cluster after it started (the cluster, its steps, the served model, the
# floor): the steps to run on it, say with a rate measured on it first (`sustained`).
Prepare = Callable[[Cluster, list[Step], str, Floor], list[Step]]


def execute(ctx: Context, prepare: Prepare | None = None) -> list[dict[str, Any]]:
    """Every step of the plan; one record per (step, system), failures recorded, not raised
    (except that our own router failing to start is an error of the project). `prepare`
    may replace a cluster's steps once the cluster runs."""
    plan = ctx.plan
    overall = ctx.progress.add_task("runs", total=plan.runs())
    records: list[dict[str, Any]] = []
    built: dict[int, Workload] = {}
    rotation = 0
    for cluster_name, spec in plan.clusters.items():
        steps = [s for s in plan.steps if s.cluster == cluster_name]
        if not steps:
            continue
        boot = ctx.progress.add_task(f"start {cluster_name} ({spec.instances} workers)", total=1)
        ctx.progress.refresh()
        cluster = Cluster.create(spec, ctx.model_dir, ctx.log_dir, plan.max_total_tokens)
        try:
            cluster.start()
            advance(ctx.progress, boot)
            model = served_model(cluster.workers[0].url)
            info = cluster.server_info()[0]
            floor = Floor.of_worker(info)
            if prepare is not None:
                steps = prepare(cluster, steps, model, floor)
            for step in steps:
                workload = built.get(id(step.workload))
                if workload is None:
                    workload = built[id(step.workload)] = step.workload.build(ctx.vocab)
                systems = list(step.systems)
                k = rotation % len(systems)
                rotation += 1
                for system in systems[k:] + systems[:k]:
                    record = run_one(ctx, cluster, step, system, workload, model, floor)
                    records.append(record)
                    advance(ctx.progress, overall)
        finally:
            cluster.stop()
    return records


def base_record(
    step: Step, system: RouterSpec, cluster: Cluster, workload: Workload
) -> dict[str, Any]:
    return {
        "system": system.name,
        "router": system.router,
        "policy": system.policy,
        "cluster": step.cluster,
        "cluster_label": cluster.spec.label,
        "instances": cluster.spec.instances,
        "pd_caching": cluster.spec.caching,
        "radix_cache": cluster.spec.radix_cache,
        "hicache_ratio": cluster.spec.hicache_ratio,
        "time_scale": cluster.spec.time_scale,
        "workload": workload.name,
        "workload_title": workload.title,
        "api": workload.api,
        "group": step.group,
        "rate": step.rate,
        "sessions": workload.sessions,
        "available": True,
        "reason": None,
        **step.labels,
    }


def run_one(
    ctx: Context,
    cluster: Cluster,
    step: Step,
    system: RouterSpec,
    workload: Workload,
    model: str,
    floor: Floor,
) -> dict[str, Any]:
    record = base_record(step, system, cluster, workload)
    record["requests"] = len(workload.requests)
    if system.router != OURS:
        status = ctx.peers[system.router]
        record["router_version"] = status.version
        if not status.importable:
            return {**record, "available": False, "reason": status.reason}
    if cluster.adapters_at_start:  # every system meets the adapters the cluster started with
        record["lora_reloads"] = cluster.reset_adapters()
    cluster.flush()
    label = f"{workload.name} @{step.rate:g}/s: {system.name} [{cluster.spec.name}]"
    task: TaskID = ctx.progress.add_task(label, total=len(workload.requests))
    ctx.progress.refresh()
    try:
        start = start_replicated if system.replicas > 1 else start_router
        router = start(system, cluster, ctx.log_dir, model)
    except RuntimeError as exc:
        ctx.progress.remove_task(task)
        if system.router == OURS:
            raise
        return {**record, "available": False, "reason": f"failed to start: {exc}"[:500]}
    record.update(router.extra)  # the front's overhead, for replicas
    if router.routers and cluster.kv_events:
        urls = [s.url for s in router.routers]
        record["events_synced"] = sync_events(urls, cluster, api_key=system.api_key)
    else:
        cluster.flush()  # the start-up probe must not warm anyone's cache
    replicas_before = replica_metrics(router)
    pages_before, bytes_before = cluster.kv_moved()
    counters_before = cluster.worker_counters()
    tiers_before = cluster.tier_counters()
    workers_cpu = cluster.cpu_seconds()
    busy_before = cluster.busy_seconds()
    client_cpu = time.process_time()
    last_refresh = [0.0]

    def on_done(_: Record) -> None:
        ctx.progress.advance(task)
        now = time.monotonic()
        if now - last_refresh[0] > 0.5:
            last_refresh[0] = now
            ctx.progress.refresh()

    router_metrics: dict[str, float] = {}
    try:
        render = ctx.tokenizer.render_chat
        result = run_async(run_workload(router.url, workload, model, on_done, render=render))
        client_cpu = time.process_time() - client_cpu
        workers_cpu = cluster.cpu_seconds() - workers_cpu
        router_cpu = router.cpu_seconds()
        router_metrics = summed(scrape(s.url + "/metrics", system.api_key) for s in router.routers)
        if router.replicas:  # before they stop: their lag histograms go with them
            record["propagation"] = propagation(replicas_before, replica_metrics(router))
    finally:
        router.stop()
    pages_after, bytes_after = cluster.kv_moved()
    counters_after = cluster.worker_counters()
    tiers_after = cluster.tier_counters()
    busy = [b - a for a, b in zip(busy_before, cluster.busy_seconds(), strict=True)]
    ctx.progress.remove_task(task)
    ctx.progress.refresh()
    servers = prefill_servers([w.role for w in cluster.workers])
    # the workers' device KV: the record's, and the LRU reference's capacity
    info = cluster.server_info()[0]
    capacity = record["worker_capacity_tokens"] = info.get("max_total_num_tokens")
    # the LRU reference models device caches alone: none where a host tier holds more
    lru = None
    if capacity and not cluster.spec.hicache_ratio:
        lru = LruCaches(servers, int(capacity))
    oracle = replay(ctx.encoder, workload.requests, result.records, lru)
    hits, lengths = oracle.hits, oracle.lengths
    warmups = [o for o in result.records if workload.requests[o.rid].warmup]
    measured = [o for o in result.records if not workload.requests[o.rid].warmup]
    record.update(summarize(measured, hits, lengths, result.wall_s))
    answered = [o.rid for o in measured if o.ok]
    sent: list[float | None] = [None] * len(workload.requests)
    for o in result.records:
        sent[o.rid] = o.sent_s
    adapters = run_adapters(cluster, workload, floor, info)
    before = adapters.unavoidable_s(sent) if adapters else None
    record.update(floor.stats(hits, lengths, answered, before))
    record.update(
        queued_floor_stats(floor, hits, lengths, sent, answered, servers, adapters=adapters)
    )
    if oracle.lru_hits is not None:
        lru_hits = oracle.lru_hits
        record.update(lru_reference(floor, lru_hits, lengths, sent, answered, servers, adapters))
    record["floor_model"] = {
        "chunked_prefill_size": floor.chunk,
        "time_scale": floor.time_scale,
        "lora_load_s": floor.lora_load_s if adapters else 0.0,  # adapter_floor: paid in floors
    }
    tenants = per_tenant(workload.requests, result.records)
    if tenants is not None:  # requests sent for tenants: their figures, their fair shares
        record["per_tenant"] = tenants
        if step.labels.get("tenant_shares"):
            record.update(fairness(tenants, step.labels["tenant_shares"]))
    record["oracle_distinct_tokens"] = oracle.distinct_tokens
    record["tiers"] = {k: v - tiers_before.get(k, 0.0) for k, v in tiers_after.items()}
    record["kv_pulled_bytes"] = record["tiers"].get("pulled_bytes", 0.0)
    if warmups:  # a failed warm-up is a failure like any other (the targets say so)
        failed = [o.problem for o in warmups if not o.ok]
        record["warmup_requests"], record["warmup_errors"] = len(warmups), len(failed)
        record["warmup_retries_429"] = sum(o.retries_429 for o in warmups)
        record["error_samples"] = sorted({*record["error_samples"], *failed})[:5]
    record["kv_pages_moved"] = pages_after - pages_before
    record["kv_bytes_moved"] = bytes_after - bytes_before
    record["wall_s"] = result.wall_s
    record["per_worker"] = [
        {k: after[k] - before.get(k, 0.0) for k in after}
        for before, after in zip(counters_before, counters_after, strict=True)
    ]
    # Engines: requests retracted under KV pressure (and resumed) and requests they aborted.
    record["retracted"] = sum(w.get("retracted", 0.0) for w in record["per_worker"])
    record["engine_aborts"] = sum(w.get("aborted", 0.0) for w in record["per_worker"])
    record["router_decisions"] = decisions(router_metrics)
    span = active_span(result.records, result.wall_s)  # warm-ups kept the GPUs busy too
    record["gpu_busy_s"] = busy
    record["worker_roles"] = [w.role for w in cluster.workers]
    if step.samples:  # every measured TTFT, for distributions (CDFs)
        record["ttft_samples_s"] = sorted(
            round(o.ttft_s, 5) for o in measured if o.ok and o.ttft_s is not None
        )
    # busy is modelled (H100) seconds: each worker's times its own scale is wall-clock
    scales = cluster.spec.scales
    record["gpu_utilization"] = (
        sum(b * s for b, s in zip(busy, scales, strict=True)) / (len(busy) * span)
        if busy and span
        else None
    )
    if len(set(scales)) > 1:  # a mixed cluster: which worker is how slow
        record["worker_time_scales"] = scales
    record["cpu_s"] = {"client": client_cpu, **router_cpu, "workers": workers_cpu}
    # The machine's 1-minute load at the end: above its core count, something else (another
    # benchmark, a test suite) competed for the CPU during this run.
    record["loadavg_1m"] = os.getloadavg()[0]
    with contextlib.suppress(KeyError):
        record["workload_params"] = dict(workload.params)
    return record


def summed(scrapes: Iterable[dict[str, float]]) -> dict[str, float]:
    """Several routers' metrics as one (each sample added up): replicas' decisions."""
    out: dict[str, float] = {}
    for metrics in scrapes:
        for name, value in metrics.items():
            out[name] = out.get(name, 0.0) + value
    return out


def decisions(metrics: dict[str, float]) -> dict[str, float] | None:
    """Our router's routing reasons and its trees' predicted vs reported cached tokens."""
    if not metrics:
        return None
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name.startswith("sgl_router_load_balancing_events_total{"):
            reason = name.split('reason="', 1)[1].split('"', 1)[0]
            out[f"reason:{reason}"] = value
    for key in (
        "memserve_router_predicted_cached_tokens_total",
        "memserve_router_reported_cached_tokens_total",
        "memserve_router_tree_corrections_total",
        # per worker, summed: reported cached tokens the trees had predicted (min of the
        # two per answer), and the reported ones of those answers
        "memserve_router_worker_predicted_hit_tokens_total",
        "memserve_router_worker_reported_cached_tokens_total",
    ):
        if key in metrics:
            out[key.removeprefix("memserve_router_").removesuffix("_total")] = metrics[key]
    # each worker's learned speed at the end of the run (router.speed), by its URL
    for name, value in metrics.items():
        for family in ("memserve_router_worker_speed{", "memserve_router_worker_overhead_seconds{"):
            if name.startswith(family):
                labels = name[len(family) : -1]
                worker = labels.split('worker="', 1)[1].split('"', 1)[0]
                term = labels.split('term="', 1)[1].split('"', 1)[0] if "term=" in labels else ""
                out[f"speed:{worker}:{term or 'overhead_s'}"] = value
    return out


def run_adapters(
    cluster: Cluster, workload: Workload, floor: Floor, info: dict[str, Any]
) -> RunAdapters | None:
    """What the floors need of a run's LoRA adapters (`adapter_floor`; `info`: a worker's
    server info): None unless its requests name adapters that its workers registered."""
    named = [r.lora for r in workload.requests]
    if not cluster.adapters_at_start or not any(named):
        return None
    workers = [w for w in cluster.workers if w.role in PREFILL_ROLES]
    lora = info.get("lora") or {}
    capacity = lora.get("max_loaded_loras")
    return RunAdapters(
        named,
        [list(cluster.adapters_at_start.get(w.url, ())) for w in workers],
        capacity if isinstance(capacity, int) and capacity > 0 else None,
        floor.lora_load_s,
    )
