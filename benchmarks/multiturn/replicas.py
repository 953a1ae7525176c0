"""Our router as replicas behind a round-robin front: start, calibrate, measure, stop.

A replicated system is a private redis-server (no persistence), N routers sharing state
through it (`--redis-url`, a distinct `--replica-id` each, `--kv-events-subscribe` when the
cluster publishes KV events) and the front (`benchmarks.multiturn.front`) that the client
talks to. Consecutive requests of one session land on different replicas, so a turn is routed
on what the other replica learnt from the previous one: the propagation delay this measures
(each replica's `memserve_router_replica_lag_seconds`, op published -> applied elsewhere).

The front is one more hop a single router does not have; `front_overhead` measures what it
adds (the same requests straight to a replica and through the front, interleaved) so the two
systems can be compared honestly.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.multiturn.cluster import (
    RouterSpec,
    RunningRouter,
    chat_probe,
    launch,
    router_args,
    slug,
)
from localrun.cluster import Cluster, scrape
from localrun.processes import (
    Server,
    free_port,
    module_command,
    redis_url,
    start_redis,
    stop_all,
    wait_until,
)

LAG = "memserve_router_replica_lag_seconds"
OPS = ("published", "applied", "dropped")  # memserve_router_replica_ops_*_total
CALIBRATION_ROUNDS = 100  # per target: hop round trips (GET /liveness)
CALIBRATION_CHATS = 20  # per target: streamed 2-token chats


def start_replicated(
    spec: RouterSpec, cluster: Cluster, log_dir: Path, model: str, timeout_s: float = 90
) -> RunningRouter:
    """redis-server, `spec.replicas` routers and the front, each answering before the next
    part starts; the front's overhead measured. RuntimeError (with a log's tail) when a part
    does not come up; whatever started is stopped then."""
    base = log_dir / f"{cluster.spec.name}-{slug(spec.name)}"
    started: list[Server] = []
    try:
        redis = start_redis(Path(f"{base}-redis.log"), timeout_s)
        started.append(redis)
        url = redis_url(redis)
        replicas = []
        for i in range(1, spec.replicas + 1):
            port = free_port()
            args = router_args(spec, cluster, port)
            args += ["--redis-url", url, "--replica-id", f"replica-{i}"]
            server = launch(f"replica-{i}", args, port, Path(f"{base}-replica-{i}.log")).start()
            started.append(server)
            replicas.append(server)
        for server in replicas:  # they boot in parallel
            ready(server, chat_probe(server.url, model), timeout_s)
        port = free_port()
        args = [f"--replica={r.url}" for r in replicas]
        command = module_command("benchmarks.multiturn.front", port, args)
        front = launch("front", command, port, Path(f"{base}-front.log")).start()
        started.append(front)
        ready(front, chat_probe(front.url, model), timeout_s)
    except BaseException:
        stop_all(started)
        raise
    running = RunningRouter(spec, front, replicas, [redis])
    running.extra["front_overhead"] = front_overhead(front.url, replicas[0].url, model)
    return running


def ready(server: Server, probe: Callable[[], bool], timeout_s: float) -> None:
    why = wait_until(server, probe, timeout_s)
    if why is not None:
        raise RuntimeError(why)


# --------------------------------------------------------------------------- the front's cost


def front_overhead(front_url: str, replica_url: str, model: str) -> dict[str, Any]:
    """What the front adds to a request, from the same requests sent straight to a replica
    and through the front, interleaved, each over its own kept-alive connection (as the
    benchmark's client does): a bare round trip (GET /liveness) and a streamed 2-token chat
    (the time to its end, every chunk relayed). Medians and p90s in ms; the difference of
    medians is the front's cost. Sent before the run's caches are flushed."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "calibrate the front, please"}],
            "max_tokens": 2,
            "stream": True,
        }
    ).encode()
    targets = {"direct": replica_url, "front": front_url}
    out: dict[str, Any] = {}
    for name, method, path, payload, rounds in (
        ("liveness", "GET", "/liveness", None, CALIBRATION_ROUNDS),
        ("chat_stream", "POST", "/v1/chat/completions", body, CALIBRATION_CHATS),
    ):
        samples = timed(targets, method, path, payload, rounds)
        figures: dict[str, Any] = {"requests_each": rounds}
        for target, times in samples.items():
            figures[f"{target}_p50_ms"] = statistics.median(times) * 1e3
            figures[f"{target}_p90_ms"] = statistics.quantiles(times, n=10)[-1] * 1e3
        figures["added_p50_ms"] = figures["front_p50_ms"] - figures["direct_p50_ms"]
        out[name] = figures
    return out


def timed(
    targets: dict[str, str], method: str, path: str, body: bytes | None, rounds: int
) -> dict[str, list[float]]:
    """Seconds per request to each target, alternating targets; two warm-up requests each."""
    conns = {name: connection(url) for name, url in targets.items()}
    samples: dict[str, list[float]] = {name: [] for name in targets}
    headers = {"Content-Type": "application/json"}
    try:
        for i in range(rounds + 2):
            for name, conn in conns.items():
                started = time.perf_counter()
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise RuntimeError(f"calibration: {name} {path} answered {response.status}")
                if i >= 2:
                    samples[name].append(time.perf_counter() - started)
    finally:
        for conn in conns.values():
            conn.close()
    return samples


def connection(url: str) -> http.client.HTTPConnection:
    host, _, port = url.removeprefix("http://").partition(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


# --------------------------------------------------------------------------- propagation delay


def replica_metrics(running: RunningRouter) -> list[dict[str, float]]:
    """Every replica's /metrics now (an empty dict for one that does not answer)."""
    return [scrape(s.url + "/metrics") for s in running.replicas]


def propagation(
    before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
) -> dict[str, Any]:
    """The run's share of the replicas' lag histograms and op counters (after minus before),
    pooled over the replicas and per replica: count, mean, p50/p90/p99 (interpolated within
    the histogram's buckets, as Prometheus' histogram_quantile does), ops published, applied
    and dropped."""
    pooled: dict[float, float] = {}
    per_replica = []
    totals = {"count": 0.0, "sum": 0.0, **{op: 0.0 for op in OPS}}
    for b, a in zip(before, after, strict=True):
        buckets = {le: n - bucket_counts(b).get(le, 0.0) for le, n in bucket_counts(a).items()}
        figures = {
            "count": a.get(f"{LAG}_count", 0.0) - b.get(f"{LAG}_count", 0.0),
            "sum": a.get(f"{LAG}_sum", 0.0) - b.get(f"{LAG}_sum", 0.0),
        }
        for op in OPS:
            key = f"memserve_router_replica_ops_{op}_total"
            figures[op] = a.get(key, 0.0) - b.get(key, 0.0)
        per_replica.append({**figures, **quantiles(buckets)})
        for key, value in figures.items():
            totals[key] += value
        for le, n in buckets.items():
            pooled[le] = pooled.get(le, 0.0) + n
    mean = totals["sum"] / totals["count"] if totals["count"] else None
    return {**totals, "mean_s": mean, **quantiles(pooled), "per_replica": per_replica}


def bucket_counts(metrics: dict[str, float]) -> dict[float, float]:
    """The lag histogram's cumulative bucket counts by upper bound (+Inf included)."""
    prefix = f'{LAG}_bucket{{le="'
    return {
        float(name[len(prefix) :].split('"', 1)[0]): value
        for name, value in metrics.items()
        if name.startswith(prefix)
    }


def quantiles(buckets: dict[float, float]) -> dict[str, float | None]:
    return {f"p{q}_s": bucket_quantile(buckets, q / 100) for q in (50, 90, 99)}


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within the bucket it falls in (the
    first bucket starts at 0; one in +Inf is given the largest finite bound)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if upper == float("inf"):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower
