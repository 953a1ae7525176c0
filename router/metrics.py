"""The router's Prometheus metrics: sglang-router's `sgl_router_*` names, plus the prompt
trees' quality figure (predicted versus reported cached tokens, router-wide and per worker,
and the prediction accuracy over the last minute: router.accuracy).

With several processes (`--processes N`) every process writes its counters and histograms
to files in the router's private PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode), and whichever process answers /metrics sums them: requests, errors,
decisions, TTFT, per-worker counts, admission holds and refusals, the trees' predicted and
reported tokens (router-wide and per worker) count the whole router. What every process
knows alike (worker health and load, tree size, expected waits, KV-event counts: each
process hears every event) comes from the answering process's own state, and so does the
prediction accuracy gauge (each process's window holds the answers it relayed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from router.accuracy import AccuracyWatch
from router.admission import Admission
from router.metric_values import use_buffered_files, write_buffered
from router.trees import PromptTrees
from router.workers import Worker, WorkerRegistry, WorkerType

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several router processes
    use_buffered_files(os.getpid())

# time to first token: 10 ms (a cached prompt) to a minute (a long one queued)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2, 5, 10, 20, 60)

# what the KV-event feeds count (router.kv_events.listener, router.kv_events.subscriber)
KV_EVENT_COUNTERS = {
    "batches": "KV event batches applied to the prompt trees",
    "gaps": "KV event batches that came after missing ones",
    "replayed": "KV event batches recovered from workers' replay sockets",
    "lost": "KV event batches missed and not recovered",
    "restarts": "Workers whose KV events started again (a new process)",
    "unknown_topics": "KV event batches from workers the router does not know",
}


ADMISSION_COUNTERS = {
    "holds": (
        "memserve_router_admission_holds",
        "Requests that waited in the router's queue, by why",
    ),
    "refusals": (
        "memserve_router_admission_refusals",
        "Requests refused with 429 before reaching a worker, by why",
    ),
}


# per worker, answers where it reported cached tokens (router.accuracy's totals)
WORKER_PREDICTION_COUNTERS = {
    "predicted": (
        "memserve_router_worker_predicted_cached_tokens",
        "Cached tokens the trees predicted for the worker, in answers where it reported its own",
    ),
    "reported": (
        "memserve_router_worker_reported_cached_tokens",
        "Cached tokens the worker reported",
    ),
    "foreseen": (
        "memserve_router_worker_predicted_hit_tokens",
        "Reported cached tokens the trees had predicted: min(predicted, reported) per answer",
    ),
}
ACCURACY_GAUGE = (
    "memserve_router_prediction_accuracy",
    "Predicted hit tokens over reported cached tokens in the last minute, per worker and "
    'for all (worker="all"); absent when nothing was reported',
)


MAX_GROUP_LABELS = 64  # tenants (or adapters) labelled by name; the rest count as "other"


class _Figures:
    """Requests, prompt and cached tokens of the answered ones (the hit ratio) and time to
    first token, of a kind of requests (`what`), by `labels`."""

    def __init__(self, r: CollectorRegistry, prefix: str, what: str, labels: list[str]) -> None:
        self.requests = Counter(
            f"{prefix}_requests", f"Inference requests {what}", labels, registry=r
        )
        self.prompt_tokens = Counter(
            f"{prefix}_prompt_tokens",
            f"Prompt tokens of answered requests {what}",
            labels,
            registry=r,
        )
        self.cached_tokens = Counter(
            f"{prefix}_cached_tokens",
            "Of those, the cached tokens the workers reported",
            labels,
            registry=r,
        )
        self.ttft = Histogram(
            f"{prefix}_time_to_first_token_seconds",
            f"Streamed requests {what}: arrival to the first token",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )


class GroupMetrics(_Figures):
    """Figures per tenant (--tenants) and per LoRA adapter: requests, prompt and cached
    tokens (the hit ratio), time to first token, and tenants' refusals. Only requests with a
    tenant or an adapter are counted here (the route metrics count them all). Label values
    are bounded: the first MAX_GROUP_LABELS tenants and adapters seen by name, the rest as
    "other" (tenants come from the operator's file, adapter names from clients)."""

    def __init__(self, r: CollectorRegistry) -> None:
        super().__init__(
            r, "memserve_router_group", "with a tenant or an adapter", ["tenant", "adapter"]
        )
        self.refusals = Counter(
            "memserve_router_tenant_refusals",
            "Requests refused at a tenant's limit (429), by reason",
            ["tenant", "reason"],
            registry=r,
        )
        self._seen: dict[str, set[str]] = {"tenant": set(), "adapter": set()}

    def labels(self, tenant: str | None, adapter: str | None) -> tuple[str, str] | None:
        """The (tenant, adapter) label values of a request; None: neither (not counted)."""
        if tenant is None and adapter is None:
            return None
        return self._bounded("tenant", tenant), self._bounded("adapter", adapter)

    def _bounded(self, kind: str, value: str | None) -> str:
        if value is None:
            return "none"
        value = value or "operator"  # the --api-key holder's tenant has no id
        seen = self._seen[kind]
        if value in seen:
            return value
        if len(seen) < MAX_GROUP_LABELS:
            seen.add(value)
            return value
        return "other"


class ModelMetrics(_Figures):
    """Figures per model (--models, router.models): requests, the hit ratio, time to first
    token, and refusals (429) by reason. Counted only when the router serves several models;
    their names come from the operator's file, so the labels are bounded."""

    def __init__(self, r: CollectorRegistry) -> None:
        super().__init__(r, "memserve_router_model", "per model (--models)", ["model"])
        self.refusals = Counter(
            "memserve_router_model_refusals",
            "Requests for a model refused with 429 before reaching a worker, by reason",
            ["model", "reason"],
            registry=r,
        )


class RouterMetrics:
    """sglang-router's `sgl_router_*` metrics plus the trees' prediction quality."""

    def __init__(
        self, workers: WorkerRegistry, trees: PromptTrees, accuracy: AccuracyWatch | None = None
    ) -> None:
        self.workers = workers
        self.trees = trees
        # what the answers' cached tokens say of the predictions (fed by router.forward.feedback)
        self.accuracy = AccuracyWatch() if accuracy is None else accuracy
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sgl_router_requests", "Requests", ["route"], registry=r)
        self.duration = Histogram(
            "sgl_router_request_duration_seconds", "Request duration", ["route"], registry=r
        )
        self.retries = Counter("sgl_router_retries", "Retries", registry=r)
        self.errors = Counter(
            "sgl_router_request_errors", "Failed requests", ["route", "reason"], registry=r
        )
        self.events = Counter(
            "sgl_router_load_balancing_events",
            "Routing decisions by reason",
            ["reason"],
            registry=r,
        )
        self.cache_hits = Counter(
            "sgl_router_cache_hits", "Routed to a predicted holder", registry=r
        )
        self.cache_misses = Counter(
            "sgl_router_cache_misses", "Routed without a predicted hit", registry=r
        )
        self.processed = Counter(
            "sgl_router_processed_requests", "Requests per worker", ["worker"], registry=r
        )
        self.pd_requests = Counter(
            "sgl_router_pd_requests", "Requests sent to a prefill/decode pair", registry=r
        )
        self.ttft = Histogram(
            "memserve_router_time_to_first_token_seconds",
            "Streamed requests: arrival at the router to the first token sent to the client",
            ["route"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.pd_errors = Counter(
            "sgl_router_pd_errors", "PD requests that failed, by side", ["side"], registry=r
        )
        self.groups = GroupMetrics(r)
        self.models = ModelMetrics(r)
        self.write_backs = Counter(
            "memserve_router_pd_write_backs",
            "PD-Caching-3 requests by the write-back gate's decision: asked, explored (asked "
            "while closed, to measure), skipped",
            ["decision"],
            registry=r,
        )
        # KV-event feed counters (name -> value), set by the router when it has a feed
        self.kv_events: Callable[[], dict[str, int]] | None = None
        # admission's hold and refusal counts, and a worker's expected wait (seconds), set
        # by the router
        self.admission: Admission | None = None
        self.expected_wait: Callable[[Worker], float] | None = None
        r.register(self)
        self._children: dict[tuple[str, str], Any] = {}
        # several processes: the counts below are summed through the multiprocess files
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._synced: dict[tuple[str, str], int] = {}
        if self.multiprocess:
            self._shared = {
                name: Counter(name, doc, registry=r) for name, doc, _ in self._tree_counts()
            }
            self._per_worker = {
                name: Counter(name, doc, ["worker"], registry=r)
                for name, doc in WORKER_PREDICTION_COUNTERS.values()
            }
            self._holds = Counter(*ADMISSION_COUNTERS["holds"], ["reason"], registry=r)
            self._refusals = Counter(*ADMISSION_COUNTERS["refusals"], ["reason"], registry=r)
            self._queued = Gauge(
                "memserve_router_admission_queued",
                "Requests waiting in the queue now",
                registry=r,
                multiprocess_mode="livesum",
            )

    def exposition(self) -> bytes:
        """The /metrics page: this process's registry, or with several processes the sum
        of their files plus what this one knows of the workers and trees."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.sync()
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        registry.register(_Live(self))
        return generate_latest(registry)

    def sync(self) -> None:
        """Several processes: write this process's tree and admission counts to its files
        (each answer to /metrics does, and every process about once a second)."""
        if not self.multiprocess:
            return
        for name, _, value in self._tree_counts():
            self._inc(self._shared[name], ("tree", name), value)
        for name, url, value in self._worker_counts():
            child = self._child(name, url, self._per_worker[name].labels)
            self._inc(child, (name, url), value)
        a = self.admission
        if a is not None:
            for counts, counter in ((a.holds, self._holds), (a.refusals, self._refusals)):
                for reason, n in counts.items():
                    self._inc(counter.labels(reason), (counter._name, reason), n)
            self._queued.set(a.queued)
        write_buffered()  # (and every count moved on the requests' path since the last sync)

    def _inc(self, counter: Any, key: tuple[str, str], value: int) -> None:
        delta = value - self._synced.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._synced[key] = value

    def _tree_counts(self) -> list[tuple[str, str, int]]:
        """The trees' counts that add up over processes (each counts its own answers)."""
        stats = self.trees.stats
        return [
            (
                "memserve_router_predicted_cached_tokens",
                "Cached tokens the trees predicted",
                stats.predicted_tokens,
            ),
            (
                "memserve_router_reported_cached_tokens",
                "Cached tokens workers reported",
                stats.reported_tokens,
            ),
            (
                "memserve_router_tree_corrections",
                "Paths dropped on worker feedback",
                stats.corrections,
            ),
        ]

    def _worker_counts(self) -> Iterator[tuple[str, str, int]]:
        """(metric, worker URL, value): the per-worker prediction totals."""
        for url, tally in self.accuracy.totals.items():
            for what, (name, _) in WORKER_PREDICTION_COUNTERS.items():
                yield name, url, getattr(tally, what)

    def _predictions(self) -> Iterator[Metric]:
        """The prediction accuracy gauge, and (one process) the per-worker counters."""
        gauge = GaugeMetricFamily(*ACCURACY_GAUGE, labels=["worker"])
        for url, value in self.accuracy.accuracy().items():
            gauge.add_metric([url], value)
        yield gauge
        if self.multiprocess:  # then summed over processes (sync)
            return
        families = {
            name: CounterMetricFamily(name, doc, labels=["worker"])
            for name, doc in WORKER_PREDICTION_COUNTERS.values()
        }
        for name, url, value in self._worker_counts():
            families[name].add_metric([url], value)
        yield from families.values()

    def _child(self, kind: str, label: str, make: Callable[[str], Any]) -> Any:
        """Labelled children, looked up once: .labels() costs microseconds per call."""
        key = (kind, label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = make(label)
        return child

    def for_route(self, route: str) -> tuple[Any, Any]:
        return (
            self._child("requests", route, self.requests.labels),
            self._child("duration", route, self.duration.labels),
        )

    def ttft_for(self, route: str) -> Any:
        return self._child("ttft", route, self.ttft.labels)

    def event(self, reason: str) -> Any:
        return self._child("event", reason, self.events.labels)

    def for_worker(self, url: str) -> Any:
        return self._child("processed", url, self.processed.labels)

    def _admission(self) -> Iterator[Metric]:
        """Requests held and refused by reason, held now, and each worker's expected wait."""
        if self.expected_wait is not None:
            wait = GaugeMetricFamily(
                "memserve_router_worker_expected_wait_seconds",
                "Cost model's expected wait before a new prefill starts on the worker",
                labels=["worker"],
            )
            for w in self.workers.workers.values():
                wait.add_metric([w.url], self.expected_wait(w))
            yield wait
        a = self.admission
        if a is None or self.multiprocess:  # then summed over processes (sync)
            return
        for what, counts in (("holds", a.holds), ("refusals", a.refusals)):
            name, doc = ADMISSION_COUNTERS[what]
            family = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in counts.items():
                family.add_metric([reason], n)
            yield family
        yield GaugeMetricFamily(
            "memserve_router_admission_queued", "Requests waiting in the queue now", a.queued
        )

    def collect(self) -> Iterator[Metric]:
        health = GaugeMetricFamily("sgl_router_worker_health", "1 healthy", labels=["worker"])
        load = GaugeMetricFamily("sgl_router_worker_load", "Requests in flight", labels=["worker"])
        breaker = GaugeMetricFamily(
            "sgl_router_cb_state", "0 closed, 1 open, 2 half-open", labels=["worker"]
        )
        # each worker's learned speed (router.speed): the coefficients over the cost model's
        # constants, and the overhead every request pays
        speed = GaugeMetricFamily(
            "memserve_router_worker_speed",
            "Learned multiple of the cost model's constant per term (queue, per_token, "
            "per_pair, transfer) on the worker; 1 is as the constants say",
            labels=["worker", "term"],
        )
        overhead = GaugeMetricFamily(
            "memserve_router_worker_overhead_seconds",
            "Learned seconds every request pays on the worker whatever its size",
            labels=["worker"],
        )
        for w in self.workers.workers.values():
            health.add_metric([w.url], 1.0 if w.healthy else 0.0)
            load.add_metric([w.url], w.load)
            breaker.add_metric([w.url], w.breaker.value)
            s = w.speed
            for term, value in (
                ("queue", s.queue_x),
                ("per_token", s.token_x),
                ("per_pair", s.pair_x),
                ("transfer", s.transfer_x),
            ):
                speed.add_metric([w.url, term], value)
            overhead.add_metric([w.url], s.overhead_s)
        yield from (health, load, breaker, speed, overhead)
        yield from self._admission()
        size = GaugeMetricFamily(
            "sgl_router_tree_size", "Pages in the prompt tree", labels=["type"]
        )
        for t in WorkerType:
            size.add_metric([t.value], self.trees.size(t))
        yield size
        stats = self.trees.stats
        # each process expires its own copy of the trees: one process's count is the router's
        expired = (
            "memserve_router_tree_expired_pages",
            "Pages expired by TTL",
            stats.expired_pages,
        )
        summed = [] if self.multiprocess else self._tree_counts()
        for name, doc, value in (*summed, expired):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        yield from self._predictions()
        if self.kv_events is not None:
            counts = self.kv_events()
            for what, help_text in KV_EVENT_COUNTERS.items():
                if what in counts:
                    name = f"memserve_router_kv_event_{what}"
                    yield CounterMetricFamily(name, help_text, counts[what])


class _Live:
    """RouterMetrics.collect as a collector of its own (a multiprocess page's registry)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.collect()
