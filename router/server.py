"""The router: its parts built and started, and the inference routes served through them.

Every refusal is a 4xx JSON body decided before any worker is touched (malformed JSON,
wrong types, empty messages, unknown model, oversized body, missing API key, full queue,
workers past the expected-wait deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from router.admission import Admission, Limits, Refused
from router.forward.dispatch import Call, Colocated, Dispatcher, Sender, Strategy
from router.forward.feedback import Learner
from router.forward.relay import RetryConfig
from router.forward.reply import ClientSide, Stream, Whole
from router.forward.upstream import UpstreamPool
from router.kv_events import (
    EventSource,
    FeedStats,
    KVEventApplier,
    KVEventListener,
    KVEventSubscriber,
    unfollowable_reason,
)
from router.metrics import RouterMetrics
from router.models import Models, ServedModel
from router.openapi import router_document
from router.pd import PDSettings, PrefillDecode
from router.policies import CostModel, Policy
from router.replicas import ReplicaConfig, ReplicatedTrees, Replicator
from router.request import (
    INFERENCE_ROUTES,
    check_model,
    full_tokens,
    parse_json_object,
    route_request,
    session_key,
    without_router_fields,
)
from router.siblings import SiblingConfig, Siblings
from router.tenants import Tenants
from router.tenants.fair import FairQueue
from router.trees import PromptTrees
from router.workers import Agent, Worker, WorkerRegistry
from shared.path_shares import PathShares
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)
PRIME_WHEN_ACTIVE_AT_MOST = 4  # requests in the router; busier, answers are not pre-encoded
# Open without the API key: probes and the API's description. /metrics on this port lists
# the workers' URLs, so it needs the key when one is set (scrapers use --prometheus-port).
OPEN_ROUTES = {"/health", "/liveness", "/readiness", "/openapi.json"}
# With --tenants, what a tenant's key opens besides the inference routes (no worker URLs).
TENANT_ROUTES = {*INFERENCE_ROUTES, "/v1/models", "/get_model_info"}
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
    tenants: Tenants | None = None  # --tenants: keys per tenant, minted salts (router.tenants)


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
        models: Models | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.trees = trees
        self.models = models  # --models: several models, each its workers (router.models)
        policies = [policy] if pd is None else [pd.prefill_policy, pd.decode_policy]
        if models is not None and pd is None:
            policies += [m.policy for m in models.served]
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
        if config.tenants is not None:  # each tenant's share of the trees and of the queue
            keys = config.tenants
            trees.shares = PathShares(
                trees.page_size, lambda tenant: keys.tree_pages(tenant, trees.max_pages)
            )
            self.admission.fair = FairQueue(keys.share)
        if self.admission.gate is not None:
            registry.when_load_changes(self.admission.load_changed)
        registry.backlogged = self.admission.short_of_slots
        self.metrics.admission = self.admission
        self.metrics.expected_wait = config.cost.queue_s
        self._active = 0  # inference requests inside the router now
        self.requests_received = 0  # inference requests this process received
        registry.when_gone(self._gone)
        registry.when_back(self._back)
        self.session: aiohttp.ClientSession | None = None  # management calls
        self.upstream = UpstreamPool()  # the inference hot path
        learner = Learner(
            trees,
            registry,
            self.metrics,
            encoder,
            self.uses_tokens,
            idle=lambda: self._active <= PRIME_WHEN_ACTIVE_AT_MOST,
            exact=config.kv_events_endpoint is not None or config.kv_events_subscribe,
        )
        sender = Sender(self.upstream, learner, self.metrics, config.request_timeout_s, config.cost)
        self.strategy: Strategy = (
            Colocated(policy, registry, sender)
            if pd is None
            else PrefillDecode(pd, registry, sender)
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
        if models is not None:  # a worker's events are keyed as its model's requests are
            self.kv_applier.model_key = lambda w: models.key_of(w.model_id)
        if config.kv_events_endpoint or config.kv_events_subscribe:
            self.metrics.kv_events = self.kv_event_counts
        self.kv_listener: KVEventListener | None = None
        self.kv_subscriber: KVEventSubscriber | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._learning: set[str] = set()  # workers being learned now
        self.replicator: Replicator | None = None
        self.siblings: Siblings | None = None
        self._expiry: asyncio.Task[None] | None = None
        self.openapi_document = router_document(VERSION)

    # ----------------------------------------------------------------- app

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
        await asyncio.gather(*(self.learn_model(w) for w in self.registry.workers.values()))
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        if self.metrics.multiprocess:
            self._background.add(asyncio.get_running_loop().create_task(self._metrics_loop()))
        if self.config.siblings is not None:
            if not isinstance(self.trees, ReplicatedTrees):
                raise TypeError("sibling processes need ReplicatedTrees")
            adopt = self._adopt if self.checks else self.learn_model
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
        served = self.models.served if self.models is not None else []
        for encoder in [
            self.encoder,
            *(m.encoder for m in served if m.encoder is not self.encoder),
        ]:
            if encoder is not None:
                encoder.close()
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

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the router's management session is not started")
        return self.session

    async def learn_model(self, worker: Worker) -> None:
        """The worker's model (for `model` checks) and its MemPool agent, when it has one
        (our workers with --enable-mempool-pull: requests may then name prefixes to pull)."""
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with self.http().get(worker.url + "/v1/models", timeout=timeout) as resp:
                body = await resp.json(content_type=None)
            learned = body["data"][0]["id"]
            self.model_ids.add(learned)
            if self.models is None or worker.model_id is None:
                worker.model_id = learned
            elif worker.model_id != learned:  # given (--models, POST /workers): kept
                log.warning("%s serves %r, given as %r", worker.url, learned, worker.model_id)
            if self.models is not None and worker.model_id not in self.models.by_name:
                log.warning(
                    "%s serves %r, not in --models: no request goes there",
                    worker.url,
                    worker.model_id,
                )
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError):
            log.warning("could not learn the model of %s", worker.url)
        try:
            async with self.http().get(worker.url + "/get_server_info", timeout=timeout) as resp:
                info = await resp.json(content_type=None) if resp.status == 200 else None
            worker.learned = True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            info = None
        worker.agent = Agent.from_server_info(info)
        if isinstance(info, dict):
            worker.adapters.learn(info)
        capacity = info.get("max_total_num_tokens") if isinstance(info, dict) else None
        if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
            worker.kv_capacity = capacity
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
        worker.free_tokens = -1  # until its events tell again

    def _back(self, worker: Worker) -> None:
        """Healthy again: learn it anew (a restarted worker may have a new agent, and one
        that was down when the router started has not been learned yet)."""
        if worker.url in self._learning:
            return
        self._learning.add(worker.url)
        task = asyncio.get_running_loop().create_task(self.learn_model(worker))
        task.add_done_callback(lambda _: self._learning.discard(worker.url))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _adopt(self, worker: Worker) -> None:
        """A worker another replica added: checked and learned as if added here."""
        await self.registry.check(worker)
        await self.learn_model(worker)

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
        self.requests_received += 1
        tenants, tenant = self.config.tenants, None
        served: ServedModel | None = None
        try:
            body = parse_json_object(raw)
            raw = without_router_fields(body, raw)
            try:  # 401, or 429 at the tenant's limits; 404 for a model not served
                if tenants is not None:
                    tenant = tenants.enter(headers.get("authorization"))
                if self.models is None:
                    check_model(body, self.model_ids)
                else:
                    served = self.models.resolve(body.get("model"))
                    self.metrics.models.requests.labels(served.name).inc()
                encoder = self.encoder if served is None else served.encoder
                if tenants is not None and tenant is not None:  # its salt, public prefix
                    raw = tenants.namespace(tenant, route, body, raw, encoder)
            except Refused as refused:
                self._refused_tenant(headers.get("authorization"), refused)
                raise
            # Admitted with its body in hand: from here until the worker counts it in flight
            # nothing waits, so the next admission by expected wait sees its load.
            async with self.admission.slot(None if tenant is None else tenant.id):
                key, policy = ("", None) if served is None else (served.key, served.policy)
                encoder = encoder if self.uses_tokens else None
                prompt = route_request(route, body, encoder, self.uses_text, key)
                if prompt.rest and encoder is not None and (busy := encoder.encoding(prompt.rest)):
                    # Its new text is being encoded for another request, on a thread (as
                    # one encode blocking the loop, it would be known by now): wait for it.
                    await asyncio.wait(busy)
                    prompt = route_request(route, body, encoder, self.uses_text, key)
                if self.replicator is not None and prompt.rest:
                    # Text this replica never encoded may be on a path another one recorded:
                    # encode it before routing (only its new pieces; the cache has the rest).
                    full_tokens(prompt, encoder)
                prompt.session = session_key(headers, body)
                if served is not None:
                    prompt.model, prompt.encoder = served.name, encoder
                if tenant is not None:
                    prompt.tenant = tenant.id
                    if self.admission.fair is not None:
                        prompt.charge = self.admission.fair.charger(tenant.id)
                group = self.metrics.groups.labels(prompt.tenant, prompt.adapter)
                if group is not None:
                    self.metrics.groups.requests.labels(*group).inc()
                try:
                    call = Call(client, route, body, raw, prompt, started, policy)
                    return await self.dispatcher.dispatch(call)
                finally:
                    duration.observe(time.perf_counter() - started)
        except Refused as refused:
            if served is not None:
                self.metrics.models.refusals.labels(served.name, refused.reason).inc()
            raise
        finally:
            self._active -= 1
            if tenants is not None and tenant is not None:
                tenants.exit(tenant)

    def _refused_tenant(self, authorization: str | None, refused: Refused) -> None:
        tenants = self.config.tenants
        tenant = tenants.identify(authorization) if tenants is not None else None
        if tenant is not None:
            label = self.metrics.groups.labels(tenant.id, None)
            assert label is not None
            self.metrics.groups.refusals.labels(label[0], refused.reason).inc()

    def authorized(self, path: str, authorization: str) -> bool:
        """The API key, when one is set, on every route but the open ones; with --tenants,
        a tenant's key too, on the routes a tenant may use (router.tenants)."""
        if path in OPEN_ROUTES:
            return True
        if self.config.tenants is not None:
            return self.config.tenants.authorized(path, authorization, TENANT_ROUTES)
        if not self.config.api_key:
            return True
        expected = f"Bearer {self.config.api_key}"
        return hmac.compare_digest(authorization.encode(), expected.encode())

    def kv_event_counts(self) -> dict[str, int]:
        info = self.kv_events_info() or {}
        counts = {k: v for k, v in info.items() if isinstance(v, int)}
        if self.config.kv_events_subscribe:  # the feeds' counters, zero until they start
            counts = {**FeedStats().as_dict(), **counts}
        counts["batches"] = self.kv_applier.batches
        counts["unknown_topics"] = self.kv_applier.unknown_topics
        return counts

    def kv_events_info(self) -> dict[str, object] | None:
        if self.kv_subscriber is not None:
            return {**self.kv_subscriber.info(), "batches_applied": self.kv_applier.batches}
        return None if self.kv_listener is None else self.kv_listener.info()
