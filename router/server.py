"""The router's HTTP surface: SGLang's and OpenAI's inference routes, management, metrics.

Every refusal is a 4xx JSON body decided before any worker is touched (malformed JSON,
wrong types, empty messages, unknown model, oversized body, missing API key, full queue,
workers past the expected-wait deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import aiohttp

from router.admission import Admission, Limits
from router.forward.dispatch import Call, Colocated, Dispatcher, Sender, Strategy
from router.forward.feedback import Learner
from router.forward.relay import RetryConfig
from router.forward.reply import ClientSide, Stream, Whole
from router.forward.upstream import UpstreamPool
from router.http_server import HttpRequest, Routes, json_reply
from router.kv_events import (
    EventSource,
    FeedStats,
    KVEventApplier,
    KVEventListener,
    KVEventSubscriber,
    unfollowable_reason,
)
from router.metrics import RouterMetrics
from router.openapi import router_document
from router.pd import PDSettings, PrefillDecode
from router.policies import CostModel, Policy
from router.replicas import ReplicaConfig, ReplicatedTrees, Replicator
from router.request import (
    RequestError,
    check_model,
    full_tokens,
    parse_json_object,
    route_request,
    session_key,
    without_router_fields,
)
from router.siblings import SiblingConfig, Siblings
from router.trees import PromptTrees
from router.workers import Agent, Worker, WorkerRegistry, WorkerType, normalize_url
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)
PRIME_WHEN_ACTIVE_AT_MOST = 4  # requests in the router; busier, answers are not pre-encoded
# Open without the API key: probes and the API's description. /metrics on this port lists
# the workers' URLs, so it needs the key when one is set (scrapers use --prometheus-port).
OPEN_ROUTES = {"/health", "/liveness", "/readiness", "/openapi.json"}
VERSION = "0.1.0"
PROCESS_HEADER = "X-Router-Process"  # --processes: the index of the process that answered
METRICS_SYNC_S = 1.0  # several processes: counts written to the metrics files this often


@dataclass(slots=True)
class RouterConfig:
    api_key: str | None = None
    max_payload_bytes: int = 512 * 1024 * 1024
    request_timeout_s: float = 1800.0
    max_concurrent_requests: int = 0  # 0: unlimited
    rate_limit_per_s: float = 0.0  # requests admitted a second (token bucket); 0: unlimited
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    # hold (then refuse) requests while every eligible worker's expected wait is past this;
    # 0: off (router.admission)
    max_expected_wait_s: float = 0.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    kv_events_endpoint: str | None = None  # bind a ZMQ SUB socket here for KV events
    kv_events_subscribe: bool = False  # connect to every worker's KV-event publisher
    cost: CostModel = field(default_factory=CostModel)  # the policies' expected-TTFT terms
    replica: ReplicaConfig | None = None  # share state with other replicas through Redis
    siblings: SiblingConfig | None = None  # one of several processes of this router


class Router:
    """The HTTP surface: admission, parsing, the dispatcher, management; keeps the trees."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        trees: PromptTrees,
        policy: Policy,
        encoder: CachedEncoder | None,
        pd: PDSettings | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.trees = trees
        policies = [policy] if pd is None else [pd.prefill_policy, pd.decode_policy]
        self.policy = policies[0]
        self.uses_tokens = any(p.uses_tokens for p in policies)
        self.uses_text = any(p.uses_text for p in policies)
        self.encoder = encoder  # None unless a policy routes on tokens
        self.model_ids: set[str] = set()
        self.metrics = RouterMetrics(registry, trees)
        self.admission = Admission(
            Limits(
                config.max_concurrent_requests,
                config.rate_limit_per_s,
                config.queue_size,
                config.queue_timeout_s,
                config.max_expected_wait_s,
            ),
            self._smallest_wait,
            self._drain_rate,
        )
        if self.admission.gate is not None:
            registry.when_load_changes(self.admission.load_changed)
        self.metrics.admission = self.admission
        self.metrics.expected_wait = config.cost.queue_s
        self._active = 0  # inference requests inside the router now
        self._requests = 0  # inference requests this process received
        registry.when_gone(self._gone)
        registry.when_back(self._back)
        self.session: aiohttp.ClientSession | None = None  # management calls
        self.upstream = UpstreamPool()  # the inference hot path
        sender = Sender(
            self.upstream,
            trees,
            self.metrics,
            encoder,
            config.request_timeout_s,
            self.uses_tokens,
        )
        self.strategy: Strategy = (
            Colocated(policy, registry, sender)
            if pd is None
            else PrefillDecode(pd, registry, sender)
        )
        learner = Learner(
            trees,
            registry,
            self.metrics,
            encoder,
            self.uses_tokens,
            idle=lambda: self._active <= PRIME_WHEN_ACTIVE_AT_MOST,
            exact=config.kv_events_endpoint is not None or config.kv_events_subscribe,
        )
        self.dispatcher = Dispatcher(self.strategy, registry, self.metrics, learner, config.retry)
        # Replicas that each subscribe to every worker learn each event themselves: what
        # an event changes is not published to the others.
        quiet = (
            trees.applying
            if config.kv_events_subscribe and isinstance(trees, ReplicatedTrees)
            else contextlib.nullcontext
        )
        self.kv_applier = KVEventApplier(trees, registry, quiet)
        if config.kv_events_endpoint or config.kv_events_subscribe:
            self.metrics.kv_events = self._kv_event_counts
        self.kv_listener: KVEventListener | None = None
        self.kv_subscriber: KVEventSubscriber | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._learning: set[str] = set()  # workers being learned now
        self.replicator: Replicator | None = None
        self.siblings: Siblings | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._openapi = router_document(VERSION)

    # ----------------------------------------------------------------- app

    def routes(self) -> Routes:
        """Every route but the inference ones (router.http_app serves those first)."""
        r = Routes()
        r.add("GET", "/v1/models", self.models)
        r.add("GET", "/health", self.health)
        r.add("GET", "/liveness", self.health)
        r.add("GET", "/readiness", self.readiness)
        r.add("GET", "/get_model_info", self.first_worker_get)
        r.add("GET", "/get_server_info", self.server_info)
        r.add("*", "/flush_cache", self.flush_cache)
        r.add("GET", "/get_loads", self.loads)
        r.add("POST", "/workers", self.add_worker)
        r.add("GET", "/workers", self.list_workers)
        r.add("GET", "/workers/{url:.+}", self.get_worker)
        r.add("DELETE", "/workers/{url:.+}", self.delete_worker)
        r.add("GET", "/metrics", self.metrics_text)
        r.add("GET", "/openapi.json", self.openapi)
        return r

    def process_headers(self) -> list[tuple[str, str]]:
        """--processes: which process answered, in a header on every answer (tests,
        debugging)."""
        siblings = self.config.siblings
        return [] if siblings is None else [(PROCESS_HEADER, str(siblings.index))]

    @property
    def checks(self) -> bool:
        """Whether this process checks health, reads loads and binds the KV-event socket
        (one process per router does)."""
        return self.config.siblings is None or self.config.siblings.checks

    async def start(self) -> None:
        """Before serving: sessions, health checks, the workers learned, background tasks."""
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.registry.start(self.session, self.checks)
        if self.config.kv_events_subscribe:
            self.kv_subscriber = KVEventSubscriber(self.kv_applier)
        if self.checks:
            await self.registry.check_all()
        await asyncio.gather(*(self._learn_model(w) for w in self.registry.workers.values()))
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        if self.metrics.multiprocess:
            self._background.add(asyncio.get_running_loop().create_task(self._metrics_loop()))
        if self.config.siblings is not None:
            if not isinstance(self.trees, ReplicatedTrees):
                raise TypeError("sibling processes need ReplicatedTrees")
            adopt = self._adopt if self.checks else self._learn_model
            self.siblings = Siblings(
                self.config.siblings, self.trees, self.registry, adopt, self.encoder
            )
            await self.siblings.start()
        if self.config.kv_events_endpoint and self.checks:
            self.kv_listener = KVEventListener(self.config.kv_events_endpoint, self.kv_applier)
            self.kv_listener.start()
        if self.config.replica is not None:
            if not isinstance(self.trees, ReplicatedTrees):
                raise TypeError("replicas need ReplicatedTrees")
            self.replicator = Replicator(
                self.config.replica,
                self.trees,
                self.registry,
                self.metrics.registry,
                on_worker_added=self._adopt,
            )
            self.replicator.start()

    async def stop(self) -> None:
        if self.replicator is not None:
            await self.replicator.stop()
        if self.siblings is not None:
            await self.siblings.stop()
        if self._expiry is not None:
            self._expiry.cancel()
        if self.kv_listener is not None:
            await self.kv_listener.stop()
        if self.kv_subscriber is not None:
            await self.kv_subscriber.stop()
        for task in self._background:
            task.cancel()
        await self.registry.stop()
        await self.upstream.close()
        if self.encoder is not None:
            self.encoder.close()
        if self.session is not None:
            await self.session.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.trees.ttl_s / 4, 0.05))
            self.trees.expire()

    async def _metrics_loop(self) -> None:
        """Several processes: this one's tree and admission counts to the metrics files."""
        while True:
            await asyncio.sleep(METRICS_SYNC_S)
            self.metrics.sync()

    def _http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the router's management session is not started")
        return self.session

    async def _learn_model(self, worker: Worker) -> None:
        """The worker's model (for `model` checks) and its MemPool agent, when it has one
        (our workers with --enable-mempool-pull: requests may then name prefixes to pull)."""
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with self._http().get(worker.url + "/v1/models", timeout=timeout) as resp:
                body = await resp.json(content_type=None)
            worker.model_id = body["data"][0]["id"]
            self.model_ids.add(body["data"][0]["id"])
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError):
            log.warning("could not learn the model of %s", worker.url)
        try:
            async with self._http().get(worker.url + "/get_server_info", timeout=timeout) as resp:
                info = await resp.json(content_type=None) if resp.status == 200 else None
            worker.learned = True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            info = None
        worker.agent = Agent.from_server_info(info)
        if self.kv_subscriber is not None and info is not None:
            source = EventSource.from_server_info(worker.url, info)
            if source is not None:
                self.kv_subscriber.follow(worker.url, source)
            elif worker.url not in self.kv_subscriber.feeds:
                log.warning(
                    "cannot subscribe to the KV events of %s: %s",
                    worker.url,
                    unfollowable_reason(info),
                )

    def _gone(self, worker: Worker) -> None:
        """Removed, or marked unhealthy: the trees forget what it held. A removed worker's
        events are no longer followed; an unhealthy one's are followed afresh (it may come
        back as a new process, whose numbering starts again)."""
        self.trees.forget(worker.url)
        if self.kv_subscriber is not None:
            if worker.url in self.registry.workers:
                self.kv_subscriber.restart(worker.url)
            else:
                self.kv_subscriber.unfollow(worker.url)
        self.kv_applier.pages.pop(worker.url, None)

    def _back(self, worker: Worker) -> None:
        """Healthy again: learn it anew (a restarted worker may have a new agent, and one
        that was down when the router started has not been learned yet)."""
        if worker.url in self._learning:
            return
        self._learning.add(worker.url)
        task = asyncio.get_running_loop().create_task(self._learn_model(worker))
        task.add_done_callback(lambda _: self._learning.discard(worker.url))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _adopt(self, worker: Worker) -> None:
        """A worker another replica added: checked and learned as if added here."""
        await self.registry.check(worker)
        await self._learn_model(worker)

    # ----------------------------------------------------------------- inference

    def _smallest_wait(self) -> float | None:
        """The smallest expected wait among the workers a request may go to (None: none is
        available); admission by expected wait compares it with the deadline."""
        cost = self.config.cost
        return min((cost.queue_s(w) for w in self.strategy.eligible()), default=None)

    def _drain_rate(self) -> float | None:
        """Requests a second the workers a request may go to finish, lately (None: not
        known); a refused request's Retry-After counts the queue ahead at this rate."""
        rates = [r for w in self.strategy.eligible() if (r := w.service_rate()) is not None]
        return sum(rates) if rates else None

    async def serve_inference(
        self, route: str, headers: Mapping[str, str], raw: bytes, client: ClientSide
    ) -> Whole | Stream:
        """One inference request, its body in hand, whichever server took it. RequestError
        and Refused for what is refused (the server writes them as JSON errors)."""
        requests, duration = self.metrics.for_route(route)
        requests.inc()
        started = time.perf_counter()
        self._active += 1
        self._requests += 1
        try:
            body = parse_json_object(raw)
            raw = without_router_fields(body, raw)
            check_model(body, self.model_ids)
            # Admitted with its body in hand: from here until the worker counts it in flight
            # nothing waits, so the next admission by expected wait sees its load.
            async with self.admission.slot():
                encoder = self.encoder if self.uses_tokens else None
                prompt = route_request(route, body, encoder, self.uses_text)
                if prompt.rest and encoder is not None and (busy := encoder.encoding(prompt.rest)):
                    # Its new text is being encoded for another request, on a thread (as
                    # one encode blocking the loop, it would be known by now): wait for it.
                    await asyncio.wait(busy)
                    prompt = route_request(route, body, encoder, self.uses_text)
                if self.replicator is not None and prompt.rest:
                    # Text this replica never encoded may be on a path another one recorded:
                    # encode it before routing (only its new pieces; the cache has the rest).
                    full_tokens(prompt, encoder)
                prompt.session = session_key(headers, body)
                try:
                    call = Call(client, route, body, raw, prompt, started)
                    return await self.dispatcher.dispatch(call)
                finally:
                    duration.observe(time.perf_counter() - started)
        finally:
            self._active -= 1

    def authorized(self, path: str, authorization: str) -> bool:
        """The API key, when one is set, on every route but the open ones."""
        if not self.config.api_key or path in OPEN_ROUTES:
            return True
        expected = f"Bearer {self.config.api_key}"
        return hmac.compare_digest(authorization.encode(), expected.encode())

    # ----------------------------------------------------------------- management

    async def health(self, request: HttpRequest) -> Whole:
        return Whole(200, b"OK", {"content-type": "text/plain; charset=utf-8"})

    async def readiness(self, request: HttpRequest) -> Whole:
        """Ready when a request could be served: a healthy worker of every kind needed."""
        missing = [k.value for k in self.strategy.kinds() if not self.registry.available(k)]
        if not missing:
            return json_reply({"status": "ready"})
        return Whole.error(503, f"no healthy {' or '.join(missing)} worker")

    async def models(self, request: HttpRequest) -> Whole:
        return await self.first_worker_get(request)

    async def first_worker_get(self, request: HttpRequest) -> Whole:
        for worker in self.registry.available():
            try:
                async with self._http().get(
                    worker.url + request.path, timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    kind = {"content-type": "application/json"}
                    return Whole(resp.status, await resp.read(), kind)
            except (aiohttp.ClientError, TimeoutError):
                continue
        return Whole.error(503, "no healthy worker")

    def _worker_json(self, w: Worker) -> dict[str, Any]:
        return {
            "url": w.url,
            "type": w.type.value,
            "healthy": w.healthy,
            "load": w.load,
            "in_flight": w.in_flight,
            "circuit_breaker": w.breaker.name.lower(),
            "model_id": w.model_id,
            "bootstrap_port": w.bootstrap_port,
            "processed": w.processed,
            "kv_pull": w.can_pull,
            "serves_pulls": w.agent is not None,
            "pulls_served_in_flight": w.pulls_served,
            # its per-token prefill time over the cost model's constant (router.speed; 1.0
            # until measured), and every coefficient the router fitted
            "slowness": round(w.speed.slowness, 4),
            "slowness_samples": w.speed.samples,
            "speed": w.speed.as_json(),
        }

    async def server_info(self, request: HttpRequest) -> Whole:
        return json_reply(
            {
                "router": "memserve-router",
                "policy": self.policy.name,
                "page_size": self.trees.page_size,
                "tree_ttl_secs": self.trees.ttl_s,
                "tree_pages": {t.value: self.trees.size(t) for t in WorkerType},
                "tree_stats": {
                    "predicted_cached_tokens": self.trees.stats.predicted_tokens,
                    "reported_cached_tokens": self.trees.stats.reported_tokens,
                    "corrections": self.trees.stats.corrections,
                },
                "tokenizer": None if self.encoder is None else self.encoder.stats(),
                "kv_events": self._kv_events_info(),
                "admission": self._admission_info(),
                "workers": [self._worker_json(w) for w in self.registry.workers.values()],
                "process": self._process_info(),
                **self._replica_info(),
            }
        )

    def _admission_info(self) -> dict[str, Any]:
        a = self.admission
        return {
            "max_expected_wait_secs": a.limits.max_expected_wait_s,
            # this process's share of the router's limits (--processes)
            "max_concurrent_requests": a.limits.max_concurrent,
            "rate_limit_per_s": a.limits.rate_per_s,
            "queue_size": a.limits.queue_size,
            "queued": a.queued,
            "holds": dict(a.holds),
            "refusals": dict(a.refusals),
        }

    def _kv_event_counts(self) -> dict[str, int]:
        info = self._kv_events_info() or {}
        counts = {k: v for k, v in info.items() if isinstance(v, int)}
        if self.config.kv_events_subscribe:  # the feeds' counters, zero until they start
            counts = {**FeedStats().as_dict(), **counts}
        counts["batches"] = self.kv_applier.batches
        counts["unknown_topics"] = self.kv_applier.unknown_topics
        return counts

    def _kv_events_info(self) -> dict[str, object] | None:
        if self.kv_subscriber is not None:
            return {**self.kv_subscriber.info(), "batches_applied": self.kv_applier.batches}
        return None if self.kv_listener is None else self.kv_listener.info()

    def _process_info(self) -> dict[str, Any]:
        """Which of the router's processes answered (--processes), and its channel."""
        out: dict[str, Any] = {"pid": os.getpid(), "index": 0, "count": 1}
        out["inference_requests"] = self._requests
        if self.siblings is not None:
            out.update(self.siblings.info(), directory=str(self.siblings.config.directory))
        return out

    def _replica_info(self) -> dict[str, Any]:
        """With --redis-url: the replica's state; with it or --processes: the pages each
        holder holds (two replicas or processes have converged when theirs are equal)."""
        if not isinstance(self.trees, ReplicatedTrees):
            return {}
        out: dict[str, Any] = {"tree_holders": self.trees.holder_pages()}
        if self.replicator is not None:
            out["replica"] = self.replicator.info()
        return out

    async def flush_cache(self, request: HttpRequest) -> Whole:
        """Fan out to every worker; the trees forget everything."""

        async def one(w: Worker) -> tuple[str, int]:
            try:
                async with self._http().post(
                    w.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    return w.url, resp.status
            except (aiohttp.ClientError, TimeoutError):
                return w.url, 502

        results = dict(await asyncio.gather(*(one(w) for w in self.registry.workers.values())))
        self.trees.clear()
        ok = all(status == 200 for status in results.values())
        return json_reply({"flushed": ok, "workers": results}, 200 if ok else 400)

    async def loads(self, request: HttpRequest) -> Whole:
        return json_reply(
            {
                "workers": [
                    {
                        "worker": w.url,
                        "load": w.load,
                        "in_flight": w.in_flight,
                        "queued_tokens": w.queued_tokens,
                        "expected_wait_secs": round(self.config.cost.queue_s(w), 6),
                        "slowness": round(w.speed.slowness, 4),
                    }
                    for w in self.registry.workers.values()
                ]
            }
        )

    async def add_worker(self, request: HttpRequest) -> Whole:
        body = parse_json_object(await request.read())
        url = body.get("url")
        if not isinstance(url, str):
            raise RequestError(400, "'url' must be a string like http://host:port")
        kind = body.get("worker_type", "colocated")
        try:
            worker_type = WorkerType("colocated" if kind == "regular" else kind)
            worker = self.registry.add(url, worker_type, body.get("bootstrap_port"))
        except ValueError as exc:
            status = 409 if "already" in str(exc) else 400
            raise RequestError(status, str(exc)) from None
        if self.replicator is not None:
            self.replicator.worker_added(worker)
        if self.siblings is not None:
            self.siblings.worker_added(worker)
        await self.registry.check(worker)
        await self._learn_model(worker)
        return json_reply(self._worker_json(worker))

    async def list_workers(self, request: HttpRequest) -> Whole:
        return json_reply(
            {"workers": [self._worker_json(w) for w in self.registry.workers.values()]}
        )

    def _find(self, request: HttpRequest) -> str:
        return unquote(request.params["url"])

    async def get_worker(self, request: HttpRequest) -> Whole:
        try:
            worker = self.registry.workers[normalize_url(self._find(request))]
        except (KeyError, ValueError):
            raise RequestError(404, f"no worker {self._find(request)}") from None
        return json_reply(self._worker_json(worker))

    async def delete_worker(self, request: HttpRequest) -> Whole:
        try:
            worker = self.registry.remove(self._find(request))
        except (KeyError, ValueError) as exc:
            raise RequestError(404, str(exc).strip("'\"")) from None
        if self.replicator is not None:
            self.replicator.worker_removed(worker.url)
        if self.siblings is not None:
            self.siblings.worker_removed(worker.url)
        return json_reply({"removed": worker.url})

    async def openapi(self, request: HttpRequest) -> Whole:
        return json_reply(self._openapi)

    async def metrics_text(self, request: HttpRequest) -> Whole:
        return Whole(200, self.metrics.exposition(), {"content-type": "text/plain; version=0.0.4"})
