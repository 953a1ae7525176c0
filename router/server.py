"""The router's HTTP surface: SGLang's and OpenAI's inference routes, management, metrics.

Every refusal is a 4xx JSON body decided before any worker is touched (malformed JSON,
wrong types, empty messages, unknown model, oversized body, missing API key, full queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import generate_latest

from connector.http_errors import json_error
from router.metrics import RouterMetrics
from router.pd import (
    PDSettings,
    PrefillResult,
    bootstrap_payload,
    drain_prefill,
    merge_input_logprobs,
    pick_pair,
)
from router.policies import Decision, Policy, RouteRequest
from router.proxy import Outcome, RetryConfig, WorkerUnavailable, end_stream, forward
from router.trees import PromptTrees
from router.upstream import UpstreamPool
from router.workers import Worker, WorkerRegistry, WorkerType, normalize_url

log = logging.getLogger(__name__)
_json_decode = msgspec.json.Decoder().decode
INFERENCE_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")
PRIME_WHEN_ACTIVE_AT_MOST = 4  # requests in the router; busier, answers are not pre-encoded
LEARN_DELAY_S = 0.002  # tree updates from an answer wait this long: the loop is idle by then
OPEN_ROUTES = {"/health", "/liveness", "/readiness", "/metrics"}


class RequestError(Exception):
    """A request the router refuses; becomes a JSON error with this status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass(slots=True)
class RouterConfig:
    api_key: str | None = None
    max_payload_bytes: int = 512 * 1024 * 1024
    request_timeout_s: float = 1800.0
    max_concurrent_requests: int = 0  # 0: unlimited
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    retry: RetryConfig = field(default_factory=RetryConfig)


class Router:
    """Routes requests to workers with a policy and keeps the prompt trees current."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        trees: PromptTrees,
        policy: Policy,
        encoder: Any | None,
        pd: PDSettings | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.trees = trees
        self.policy = policy
        self.pd = pd  # prefill/decode disaggregation: pairs instead of single workers
        policies = [policy] if pd is None else [pd.prefill_policy, pd.decode_policy]
        self.uses_tokens = any(p.uses_tokens for p in policies)
        self.uses_text = any(p.uses_text for p in policies)
        self.encoder = encoder  # connector.token_cache.CachedEncoder, or None (no token policies)
        self.model_ids: set[str] = set()
        self.metrics = RouterMetrics(self)
        self._slots = (
            asyncio.Semaphore(config.max_concurrent_requests)
            if config.max_concurrent_requests > 0
            else None
        )
        self._queued = 0
        self._active = 0  # inference requests inside the router now
        registry.on_unhealthy.append(lambda w: trees.forget(w.url))
        self.session: aiohttp.ClientSession | None = None  # management calls
        self.upstream = UpstreamPool()  # the inference hot path
        self.kv_events_endpoint: str | None = None  # bind a SUB socket here for KV events
        self.kv_listener = None

    # ----------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._guard], client_max_size=self.config.max_payload_bytes
        )
        r = app.router
        for route in INFERENCE_ROUTES:
            r.add_post(route, self.inference)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/liveness", self.health)
        r.add_get("/readiness", self.readiness)
        r.add_get("/get_model_info", self.first_worker_get)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_loads", self.loads)
        r.add_post("/workers", self.add_worker)
        r.add_get("/workers", self.list_workers)
        r.add_get("/workers/{url:.+}", self.get_worker)
        r.add_delete("/workers/{url:.+}", self.delete_worker)
        r.add_get("/metrics", self.metrics_text)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.registry.start(self.session)
        await self.registry.check_all()
        await asyncio.gather(*(self._learn_model(w) for w in self.registry.workers.values()))
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        if self.kv_events_endpoint:
            from router.kv_listener import KVEventListener

            self.kv_listener = KVEventListener(self.kv_events_endpoint, self.trees, self.registry)
            self.kv_listener.start()

    async def _stop(self, app: web.Application) -> None:
        self._expiry.cancel()
        if self.kv_listener is not None:
            await self.kv_listener.stop()
        await self.registry.stop()
        await self.upstream.close()
        if self.session is not None:
            await self.session.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.trees.ttl_s / 4, 0.05))
            self.trees.expire()

    async def _learn_model(self, worker: Worker) -> None:
        try:
            async with self.session.get(
                worker.url + "/v1/models",  # type: ignore[union-attr]
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                body = await resp.json(content_type=None)
            worker.model_id = body["data"][0]["id"]
            self.model_ids.add(worker.model_id)
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError):
            log.warning("could not learn the model of %s", worker.url)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API key on protected routes; every error as JSON."""
        if self.config.api_key and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {self.config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return json_error(401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except RequestError as exc:
            return json_error(exc.status, str(exc), headers=exc.headers)
        except web.HTTPRequestEntityTooLarge:
            return json_error(
                413,
                f"request body larger than --max-payload-size "
                f"({self.config.max_payload_bytes} bytes)",
            )
        except web.HTTPException as exc:
            if exc.status >= 400:
                return json_error(exc.status, exc.reason)
            raise

    # ----------------------------------------------------------------- inference

    async def inference(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        requests, duration = self.metrics.for_route(route)
        requests.inc()
        started = time.perf_counter()
        self._active += 1
        try:
            return await self._inference(request, route, duration, started)
        finally:
            self._active -= 1

    async def _inference(
        self, request: web.Request, route: str, duration: Any, started: float
    ) -> web.StreamResponse:
        async with self._admission():
            raw = await request.read()
            body = self._parse(raw)
            self._check_model(body)
            route_request = self._tokenize(route, body, self.uses_tokens, self.uses_text)
            if not route_request.text and route_request.tokens is not None and self.uses_text:
                # sglang-router's tree sees the raw ids
                route_request.text = " ".join(map(str, route_request.tokens))
            route_request.session = request.headers.get("X-Session-Id") or (
                body.get("user") if isinstance(body.get("user"), str) else None
            )
            try:
                if self.pd is not None:
                    return await self._dispatch_pd(request, route, body, route_request)
                return await self._dispatch(request, route, body, raw, route_request)
            finally:
                duration.observe(time.perf_counter() - started)

    @contextlib.asynccontextmanager
    async def _admission(self) -> AsyncIterator[None]:
        """A slot among --max-concurrent-requests, waiting in a bounded queue, else 429."""
        slots = self._slots
        if slots is None:
            yield
            return
        if slots.locked():
            if self._queued >= self.config.queue_size:
                raise RequestError(
                    429, "the router's queue is full; retry later", {"Retry-After": "1"}
                )
            self._queued += 1
            try:
                await asyncio.wait_for(slots.acquire(), self.config.queue_timeout_s)
            except TimeoutError:
                raise RequestError(
                    429, "timed out waiting in the router's queue", {"Retry-After": "1"}
                ) from None
            finally:
                self._queued -= 1
        else:
            await slots.acquire()
        try:
            yield
        finally:
            slots.release()

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any]:
        try:
            body = _json_decode(raw)
        except msgspec.DecodeError as exc:
            raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None or not self.model_ids or model in self.model_ids or model == "default":
            return
        if not isinstance(model, str):
            raise RequestError(400, "'model' must be a string")
        raise RequestError(404, f"model {model!r} not found; served: {sorted(self.model_ids)}")

    def _tokenize(
        self, route: str, body: dict[str, Any], want_tokens: bool, want_text: bool = True
    ) -> RouteRequest:
        """Token ids as the engine will see them (uint32, only if wanted), the raw text, and
        a chat's normalized messages (None for text prompts). A chat's text that the router
        never encoded is left in `rest`, to be encoded once the request has gone.

        Malformed prompts are 400 whatever the policy; tokenizing costs milliseconds on long
        prompts, so only token-routing policies pay for it. Chat text is joined only when
        `want_text` (cache_aware's character tree).
        """
        enc = self.encoder if want_tokens else None
        if route == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "'messages' must be a non-empty list")
            parts = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise RequestError(400, f"messages[{i}] must be an object with a 'role'")
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if content is not None and not isinstance(content, str):
                    raise RequestError(400, f"messages[{i}].content must be a string or parts")
                parts.append(
                    m if isinstance(m.get("content"), str) else {**m, "content": content or ""}
                )
            text = "".join(p["content"] for p in parts) if want_text else ""
            if enc is None:
                return RouteRequest(None, text, None, chat=parts)
            try:
                known, rest = enc.encode_chat_known(parts, tools=body.get("tools"))
            except ValueError as exc:
                raise RequestError(400, f"cannot apply the chat template: {exc}") from None
            request = RouteRequest(known, text, None, chat=parts, rest=rest or None)
            request.rest_tokens = enc.estimate_tokens(rest)
            return request
        if route == "/v1/completions":
            prompt = body.get("prompt")
            if (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                return RouteRequest(array("I", prompt), " ".join(map(str, prompt)), None)
            if not isinstance(prompt, str):
                raise RequestError(400, "'prompt' must be a string or a list of token ids")
            return RouteRequest(array("I", enc.encode(prompt)) if enc else None, prompt, None)
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError(400, "give exactly one of 'text' or 'input_ids'")
        # A batch (SGLang accepts lists of prompts) routes by its first prompt.
        if isinstance(text, list):
            if not text or not all(isinstance(t, str) for t in text):
                raise RequestError(400, "'text' must be a string or a non-empty list of strings")
            text = text[0]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        if ids is not None:
            return RouteRequest(self._ids("input_ids", ids), "", None)
        if not isinstance(text, str):
            raise RequestError(400, "'text' must be a string")
        return RouteRequest(array("I", enc.encode(text)) if enc else None, text, None)

    @staticmethod
    def _ids(name: str, ids: Any) -> array:
        """Client-given token ids as uint32; 400 unless a list of non-negative ints."""
        if not isinstance(ids, list) or any(isinstance(t, bool) for t in ids):
            raise RequestError(400, f"'{name}' must be a list of token ids")
        try:
            return array("I", ids)
        except (TypeError, OverflowError):
            raise RequestError(400, f"'{name}' must be a list of token ids") from None

    async def _dispatch(
        self,
        request: web.Request,
        route: str,
        body: dict[str, Any],
        raw: bytes,
        route_request: RouteRequest,
    ) -> web.StreamResponse:
        tried: set[str] = set()
        retry = self.config.retry
        attempts = 1 + (retry.max_retries if retry.enabled else 0)
        last_error = "no healthy worker"
        for attempt in range(attempts):
            available = self.registry.available(route_request.type)
            workers = [w for w in available if w.url not in tried] or available
            if not workers:
                break
            decision = self.policy.select(route_request, workers)
            worker = decision.worker
            tried.add(worker.url)
            payload = self._payload(body, raw, decision)
            outcome = Outcome()
            try:
                response = await self._send(
                    request, route, payload, decision, outcome, route_request
                )
            except WorkerUnavailable as exc:
                last_error = str(exc)
                self.registry.record_failure(worker)
                if exc.status == 502:
                    self.registry.mark_dead(worker)
                self.metrics.errors.labels(route, "worker").inc()
                if attempt + 1 < attempts:
                    self.metrics.retries.inc()
                    await asyncio.sleep(retry.backoff(attempt))
                continue
            # Learning is for later requests: off this one's path, and off the next one's
            # (a multi-turn client sends its next turn the moment this answer lands).
            asyncio.get_running_loop().call_later(
                LEARN_DELAY_S, self._learn, route, route_request, decision, outcome
            )
            return response
        raise RequestError(
            503, f"no worker could serve the request: {last_error}", {"Retry-After": "1"}
        )

    def _payload(self, body: dict[str, Any], raw: bytes, decision: Decision) -> bytes:
        """The client's body unchanged, unless longer prefixes elsewhere are worth naming."""
        if not decision.holders:
            return raw
        hint = {"prefix_holders": [{"url": u, "cached_tokens": n} for u, n in decision.holders]}
        return json.dumps({**body, "memserve": hint}).encode()

    async def _send(
        self,
        request: web.Request,
        route: str,
        payload: bytes,
        decision: Decision,
        outcome: Outcome,
        route_request: RouteRequest,
        tree: WorkerType | None = WorkerType.COLOCATED,
    ) -> web.StreamResponse:
        """Forward to `decision.worker`, counting it in flight; `tree`: the prompt tree that
        learns (optimistically) that the worker is about to hold the prompt."""
        worker = decision.worker
        pending = max(route_request.num_tokens - decision.predicted_cached, 0)
        worker.in_flight += 1
        worker.in_flight_tokens += pending
        released = False

        def prefill_done() -> None:
            nonlocal released
            if not released:
                released = True
                worker.in_flight_tokens -= pending

        self.metrics.event(decision.reason).inc()
        (self.metrics.cache_hits if decision.predicted_cached else self.metrics.cache_misses).inc()
        if route_request.tokens is not None and tree is not None and self.uses_tokens:
            # optimistic, right after the send (the new text encoded first)
            asyncio.get_running_loop().call_soon(self._record, tree, worker.url, route_request)
        try:
            return await forward(
                self.upstream,
                request,
                worker.url + route,
                payload,  # type: ignore[arg-type]
                self.config.request_timeout_s,
                outcome,
                prefill_done,
                inspect=self.uses_tokens,  # only token policies learn from answers
            )
        finally:
            prefill_done()
            worker.in_flight -= 1
            worker.processed += 1
            self.metrics.for_worker(worker.url).inc()

    def _learn(
        self, route: str, route_request: RouteRequest, decision: Decision, outcome: Outcome
    ) -> None:
        """After the answer: breaker, feedback on cached_tokens, the next turn's prefix."""
        worker = decision.worker
        if outcome.error is not None:
            self.registry.record_failure(worker)
            self.metrics.errors.labels(route, "mid_stream").inc()
            return
        self.registry.record_success(worker)
        tokens = self._full_tokens(route_request)
        if not tokens or not self.uses_tokens or outcome.status != 200:
            return
        if outcome.cached_tokens is not None:
            self.trees.feedback(
                WorkerType.COLOCATED,
                worker.url,
                tokens,
                decision.predicted_cached,
                outcome.cached_tokens,
            )
        prefix = self._next_prefix(route_request, outcome)
        self.trees.record(WorkerType.COLOCATED, worker.url, prefix)

    def _full_tokens(self, route_request: RouteRequest) -> Any:
        """The prompt's ids, encoding the text left for after the dispatch if not done yet."""
        if route_request.rest and self.encoder is not None:
            route_request.tokens = self.encoder.complete(route_request.tokens, route_request.rest)
            route_request.rest, route_request.rest_tokens = None, 0
        return route_request.tokens

    def _record(self, tree: WorkerType, url: str, route_request: RouteRequest) -> None:
        """`url` is about to hold this prompt (its whole text encoded first)."""
        tokens = self._full_tokens(route_request)
        if tokens:
            self.trees.record(tree, url, tokens)

    def _next_prefix(self, route_request: RouteRequest, outcome: Outcome) -> array:
        """The prompt plus what was generated: the next turn's prefix.

        For a chat, the next turn's render of this answer is encoded now too (off every
        request's path): the client sends the answer back verbatim as the assistant message,
        so the next turn only has its new user message left to tokenize.
        """
        chat, enc = route_request.chat, self.encoder
        idle = self._active <= PRIME_WHEN_ACTIVE_AT_MOST  # under load the CPU serves requests
        if idle and chat is not None and enc is not None and outcome.output_text:
            with contextlib.suppress(ValueError):
                enc.prime([*chat, {"role": "assistant", "content": outcome.output_text}])
        prefix = array("I", route_request.tokens)
        if outcome.output_ids is not None:
            prefix.extend(outcome.output_ids)
        elif outcome.output_text and self.encoder is not None:
            prefix.extend(
                self.encoder.tokenizer.encode(outcome.output_text, add_special_tokens=False)
            )
        return prefix

    # ----------------------------------------------------------------- PD

    async def _dispatch_pd(
        self, request: web.Request, route: str, body: dict[str, Any], route_request: RouteRequest
    ) -> web.StreamResponse:
        """A prefill and a decode worker per request, with SGLang's bootstrap fields."""
        pd = self.pd
        assert pd is not None
        retry = self.config.retry
        attempts = 1 + (retry.max_retries if retry.enabled else 0)
        tried: set[str] = set()
        last_error = "no healthy prefill and decode pair"
        keep_prefill = bool(body.get("return_logprob")) and not body.get("stream")
        for attempt in range(attempts):
            pairs = []
            for kind in (WorkerType.PREFILL, WorkerType.DECODE):
                live = self.registry.available(kind)
                pairs.append([w for w in live if w.url not in tried] or live)
            if not pairs[0] or not pairs[1]:
                break
            p_dec, d_dec = pick_pair(pd, route_request, pairs[0], pairs[1])
            prefill, decode = p_dec.worker, d_dec.worker
            payload, _room = bootstrap_payload(body, prefill)
            self.metrics.pd_requests.inc()
            p_task = asyncio.create_task(
                self._prefill(route, payload, p_dec, route_request, keep_prefill)
            )
            if route_request.tokens is not None and self.uses_tokens and pd.caching.prefill_caches:
                loop = asyncio.get_running_loop()
                loop.call_soon(self._record, WorkerType.PREFILL, prefill.url, route_request)
            outcome = Outcome()
            d_tree = WorkerType.DECODE if pd.caching.decode_caches else None
            d_task = asyncio.create_task(
                self._send(request, route, payload, d_dec, outcome, route_request, d_tree)
            )
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if d_task not in done and p_task.result().error and not outcome.first_byte:
                # the decode would wait for KV that never comes: end it now, not at its timeout
                d_task.cancel()
                await asyncio.gather(d_task, return_exceptions=True)
                error = p_task.result().error or "prefill failed"
                self.metrics.pd_errors.labels("prefill").inc()
                self.registry.record_failure(prefill)
                if outcome.client is not None:  # a stream had begun: end it with the error
                    return await end_stream(outcome.client, error)
                raise RequestError(502, error)
            try:
                response = await d_task
            except WorkerUnavailable as exc:
                p_task.cancel()
                await asyncio.gather(p_task, return_exceptions=True)
                last_error = str(exc)
                tried.add(decode.url)
                self.registry.record_failure(decode)
                if exc.status == 502:
                    self.registry.mark_dead(decode)
                self.metrics.pd_errors.labels("decode").inc()
                if attempt + 1 < attempts:
                    self.metrics.retries.inc()
                    await asyncio.sleep(retry.backoff(attempt))
                continue
            result = await p_task
            if keep_prefill and result.body is not None and isinstance(response, web.Response):
                response.body = merge_input_logprobs(result.body, response.body)  # type: ignore[arg-type]
            asyncio.get_running_loop().call_later(
                LEARN_DELAY_S, self._learn_pd, route_request, p_dec, d_dec, outcome, result
            )
            return response
        raise RequestError(
            503,
            f"no prefill/decode pair could serve the request: {last_error}",
            {"Retry-After": "1"},
        )

    async def _prefill(
        self, route: str, payload: bytes, decision: Decision, request: RouteRequest, keep: bool
    ) -> PrefillResult:
        worker = decision.worker
        pending = max(request.num_tokens - decision.predicted_cached, 0)
        worker.in_flight += 1
        worker.in_flight_tokens += pending
        try:
            return await drain_prefill(
                self.upstream, worker.url + route, payload, self.config.request_timeout_s, keep
            )
        finally:
            worker.in_flight -= 1
            worker.in_flight_tokens -= pending
            worker.processed += 1
            self.metrics.for_worker(worker.url).inc()

    def _learn_pd(
        self,
        route_request: RouteRequest,
        p_dec: Decision,
        d_dec: Decision,
        outcome: Outcome,
        result: PrefillResult,
    ) -> None:
        """Breakers of both sides; the trees as the caching mode says the KV now lies."""
        caching = self.pd.caching  # type: ignore[union-attr]
        prefill, decode = p_dec.worker, d_dec.worker
        if result.error is None:
            self.registry.record_success(prefill)
        else:
            self.registry.record_failure(prefill)
            self.metrics.pd_errors.labels("prefill").inc()
        if outcome.error is None:
            self.registry.record_success(decode)
        else:
            self.registry.record_failure(decode)
            self.metrics.pd_errors.labels("decode").inc()
        tokens = self._full_tokens(route_request)
        if not tokens or not self.uses_tokens or outcome.status != 200 or outcome.error:
            return
        if result.cached_tokens is not None:
            self.trees.feedback(
                WorkerType.PREFILL,
                prefill.url,
                tokens,
                p_dec.predicted_cached,
                result.cached_tokens,
            )
        prefix = self._next_prefix(route_request, outcome)
        if caching.decode_caches:
            self.trees.record(WorkerType.DECODE, decode.url, prefix)
        if caching.writeback:
            self.trees.record(WorkerType.PREFILL, prefill.url, prefix)

    # ----------------------------------------------------------------- management

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def readiness(self, request: web.Request) -> web.Response:
        if self.registry.available():
            return web.json_response({"status": "ready"})
        return json_error(503, "no healthy worker")

    async def models(self, request: web.Request) -> web.Response:
        return await self.first_worker_get(request)

    async def first_worker_get(self, request: web.Request) -> web.Response:
        for worker in self.registry.available():
            try:
                async with self.session.get(
                    worker.url + request.path,  # type: ignore[union-attr]
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as resp:
                    return web.Response(
                        status=resp.status, body=await resp.read(), content_type="application/json"
                    )
            except (aiohttp.ClientError, TimeoutError):
                continue
        return json_error(503, "no healthy worker")

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
        }

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
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
                "kv_events": None
                if self.kv_listener is None
                else {
                    "endpoint": self.kv_events_endpoint,
                    "batches": self.kv_listener.batches,
                    "unknown_topics": self.kv_listener.unknown_topics,
                },
                "workers": [self._worker_json(w) for w in self.registry.workers.values()],
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Fan out to every worker; the trees forget everything."""

        async def one(w: Worker) -> tuple[str, int]:
            try:
                async with self.session.post(
                    w.url + "/flush_cache",  # type: ignore[union-attr]
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    return w.url, resp.status
            except (aiohttp.ClientError, TimeoutError):
                return w.url, 502

        results = dict(await asyncio.gather(*(one(w) for w in self.registry.workers.values())))
        self.trees.clear()
        ok = all(status == 200 for status in results.values())
        return web.json_response({"flushed": ok, "workers": results}, status=200 if ok else 400)

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "workers": [
                    {
                        "worker": w.url,
                        "load": w.load,
                        "in_flight": w.in_flight,
                        "queued_tokens": w.queued_tokens,
                    }
                    for w in self.registry.workers.values()
                ]
            }
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        body = self._parse(await request.read())
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
        await self.registry.check(worker)
        await self._learn_model(worker)
        return web.json_response(self._worker_json(worker))

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"workers": [self._worker_json(w) for w in self.registry.workers.values()]}
        )

    def _find(self, request: web.Request) -> str:
        return unquote(request.match_info["url"])

    async def get_worker(self, request: web.Request) -> web.Response:
        try:
            worker = self.registry.workers[normalize_url(self._find(request))]
        except (KeyError, ValueError):
            raise RequestError(404, f"no worker {self._find(request)}") from None
        return web.json_response(self._worker_json(worker))

    async def delete_worker(self, request: web.Request) -> web.Response:
        try:
            worker = self.registry.remove(self._find(request))
        except (KeyError, ValueError) as exc:
            raise RequestError(404, str(exc).strip("'\"")) from None
        return web.json_response({"removed": worker.url})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )
