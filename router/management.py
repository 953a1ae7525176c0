"""The router's management routes: health, models, server info, loads, workers added and
removed, cache flushes, metrics and the OpenAPI document (the inference routes are
`Router.serve_inference`, reached through router.http_app)."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

import aiohttp
import msgspec

from router.forward.reply import Whole
from router.http_server import HttpRequest, Routes, json_reply
from router.replicas import ReplicatedTrees
from router.request import RequestError, parse_json_object
from router.workers import Worker, WorkerType, normalize_url

if TYPE_CHECKING:
    from router.server import Router


class Management:
    """The management handlers of one router process, over its state."""

    def __init__(self, router: Router) -> None:
        self.router = router

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
        r.add("POST", "/add_worker", self.add_worker)
        r.add("GET", "/workers", self.list_workers)
        r.add("GET", "/workers/{url:.+}", self.get_worker)
        r.add("DELETE", "/workers/{url:.+}", self.delete_worker)
        r.add("GET", "/metrics", self.metrics_text)
        r.add("GET", "/openapi.json", self.openapi)
        return r

    async def health(self, request: HttpRequest) -> Whole:
        return Whole(200, b"OK", {"content-type": "text/plain; charset=utf-8"})

    async def readiness(self, request: HttpRequest) -> Whole:
        """Ready when a request could be served: a healthy worker of every kind needed."""
        missing = [
            k.value for k in self.router.strategy.kinds() if not self.router.registry.available(k)
        ]
        if not missing:
            return json_reply({"status": "ready"})
        return Whole.error(503, f"no healthy {' or '.join(missing)} worker")

    async def models(self, request: HttpRequest) -> Whole:
        """OpenAI's model list: with --models every served model, each with the adapters its
        workers list (SGLang's cards, `parent` the model); else the workers' own list."""
        models = self.router.models
        if models is None:
            return await self.first_worker_get(request)
        cards = await asyncio.gather(*(self._model_cards(m.name) for m in models.served))
        return json_reply({"object": "list", "data": [c for each in cards for c in each]})

    async def _model_cards(self, name: str) -> list[dict[str, Any]]:
        """A model's card and its adapters' as its available workers list them (the model's
        name alone when none answers)."""
        workers = self.router.registry.available(model=name)
        replies = await asyncio.gather(*(self._get(w, "/v1/models") for w in workers))
        cards: dict[str, dict[str, Any]] = {
            name: {"id": name, "object": "model", "owned_by": "memserve-router", "parent": None}
        }
        for reply in replies:
            listed = None if reply is None or reply.status != 200 else _cards(reply.body)
            for card in listed or ():
                if card.get("parent") is None:  # the base model: named as the router names it
                    cards[name] = {**card, "id": name}
                elif isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], {**card, "parent": name})
        return list(cards.values())

    async def first_worker_get(self, request: HttpRequest) -> Whole:
        """The first available worker's answer to a GET (/get_model_info: with --models,
        `?model=NAME` picks the model, the default one without)."""
        model = None
        if self.router.models is not None:
            name = parse_qs(request.query).get("model", [None])[0]
            model = self.router.models.resolve(name).name
        for worker in self.router.registry.available(model=model):
            reply = await self._get(worker, request.path)
            if reply is not None:
                return reply
        return Whole.error(
            503, "no healthy worker" if model is None else f"no healthy worker of {model}"
        )

    async def _get(self, worker: Worker, path: str) -> Whole | None:
        """A worker's answer to a GET of `path` (None: it did not answer)."""
        try:
            async with self.router.http().get(
                worker.url + path, timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                return Whole(resp.status, await resp.read(), {"content-type": "application/json"})
        except (aiohttp.ClientError, TimeoutError):
            return None

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
            # its device KV (server info) and how much of it is free (its KV events; None:
            # not known): a copy of a hot prefix is not sent where it would only evict
            "kv_capacity_tokens": w.kv_capacity,
            "kv_free_tokens": None if w.free_tokens < 0 else w.free_tokens,
            # its per-token prefill time over the cost model's constant (router.speed; 1.0
            # until measured), and every coefficient the router fitted
            "slowness": round(w.speed.slowness, 4),
            "slowness_samples": w.speed.samples,
            "speed": w.speed.as_json(),
            # its LoRA adapters as the router sees them (None: it serves none it knows of)
            "lora": w.adapters.as_json(),
        }

    async def server_info(self, request: HttpRequest) -> Whole:
        return json_reply(
            {
                "router": "memserve-router",
                "policy": self.router.policy.name,
                "page_size": self.router.trees.page_size,
                "tree_ttl_secs": self.router.trees.ttl_s,
                "tree_pages": {t.value: self.router.trees.size(t) for t in WorkerType},
                "tree_stats": {
                    "predicted_cached_tokens": self.router.trees.stats.predicted_tokens,
                    "reported_cached_tokens": self.router.trees.stats.reported_tokens,
                    "corrections": self.router.trees.stats.corrections,
                },
                "tokenizer": None if self.router.encoder is None else self.router.encoder.stats(),
                "kv_events": self.router.kv_events_info(),
                "admission": self._admission_info(),
                "workers": [self._worker_json(w) for w in self.router.registry.workers.values()],
                "process": self._process_info(),
                "tenants": self._tenants_info(),
                "models": None if (m := self.router.models) is None else m.info(self._urls_of),
                **self._replica_info(),
            }
        )

    def _urls_of(self, model: str) -> list[str]:
        return [w.url for w in self.router.registry.workers.values() if w.model_id == model]

    def _tenants_info(self) -> dict[str, Any] | None:
        """The tenants' counts, with their shares: tree pages held, computed tokens charged."""
        tenants = self.router.config.tenants
        if tenants is None:
            return None
        shares, fair = self.router.trees.shares, self.router.admission.fair
        computed = {} if fair is None else fair.computed
        return {
            **tenants.info(),
            "tree_pages": {} if shares is None else shares.by_group(),
            "tree_pages_deleted": 0 if shares is None else shares.deleted_pages,
            "computed_tokens": {t: round(n) for t, n in computed.items()},
        }

    def _admission_info(self) -> dict[str, Any]:
        a = self.router.admission
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

    def _process_info(self) -> dict[str, Any]:
        """Which of the router's processes answered (--processes), and its channel."""
        out: dict[str, Any] = {"pid": os.getpid(), "index": 0, "count": 1}
        out["inference_requests"] = self.router.requests_received
        if self.router.siblings is not None:
            out.update(
                self.router.siblings.info(), directory=str(self.router.siblings.config.directory)
            )
        return out

    def _replica_info(self) -> dict[str, Any]:
        """With --redis-url: the replica's state; with it or --processes: the pages each
        holder holds (two replicas or processes have converged when theirs are equal)."""
        if not isinstance(self.router.trees, ReplicatedTrees):
            return {}
        out: dict[str, Any] = {"tree_holders": self.router.trees.holder_pages()}
        if self.router.replicator is not None:
            out["replica"] = self.router.replicator.info()
        return out

    async def flush_cache(self, request: HttpRequest) -> Whole:
        """Fan out to every worker; the trees forget everything."""

        async def one(w: Worker) -> tuple[str, int]:
            try:
                async with self.router.http().post(
                    w.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    return w.url, resp.status
            except (aiohttp.ClientError, TimeoutError):
                return w.url, 502

        results = dict(
            await asyncio.gather(*(one(w) for w in self.router.registry.workers.values()))
        )
        self.router.trees.clear()
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
                        "expected_wait_secs": round(self.router.config.cost.queue_s(w), 6),
                        "slowness": round(w.speed.slowness, 4),
                    }
                    for w in self.router.registry.workers.values()
                ]
            }
        )

    async def add_worker(self, request: HttpRequest) -> Whole:
        """POST /workers with smg's JSON (`url`, `worker_type`, `bootstrap_port`,
        `model_id`), or sglang-router's POST /add_worker?url=...(&model_id=...)."""
        if request.path == "/add_worker":
            body: dict[str, Any] = {k: v[0] for k, v in parse_qs(request.query).items()}
        else:
            body = parse_json_object(await request.read())
        url = body.get("url")
        if not isinstance(url, str):
            raise RequestError(400, "'url' must be a string like http://host:port")
        kind = body.get("worker_type", "colocated")
        model_id = self._model_id(body.get("model_id"))
        try:
            worker_type = WorkerType("colocated" if kind == "regular" else kind)
            worker = self.router.registry.add(url, worker_type, body.get("bootstrap_port"))
        except ValueError as exc:
            status = 409 if "already" in str(exc) else 400
            raise RequestError(status, str(exc)) from None
        worker.model_id = model_id
        if self.router.replicator is not None:
            self.router.replicator.worker_added(worker)
        if self.router.siblings is not None:
            self.router.siblings.worker_added(worker)
        await self.router.registry.check(worker)
        await self.router.learn_model(worker)
        return json_reply(self._worker_json(worker))

    def _model_id(self, model_id: Any) -> str | None:
        """A new worker's `model_id` (None: learned from it); with --models, one of them."""
        if model_id is None:
            return None
        if not isinstance(model_id, str) or not model_id:
            raise RequestError(400, "'model_id' must be a model's name")
        models = self.router.models
        if models is not None and model_id not in models.by_name:
            served = sorted(models.by_name)
            raise RequestError(400, f"model_id {model_id!r} is not in --models; served: {served}")
        return model_id

    async def list_workers(self, request: HttpRequest) -> Whole:
        return json_reply(
            {"workers": [self._worker_json(w) for w in self.router.registry.workers.values()]}
        )

    def _find(self, request: HttpRequest) -> str:
        return unquote(request.params["url"])

    async def get_worker(self, request: HttpRequest) -> Whole:
        try:
            worker = self.router.registry.workers[normalize_url(self._find(request))]
        except (KeyError, ValueError):
            raise RequestError(404, f"no worker {self._find(request)}") from None
        return json_reply(self._worker_json(worker))

    async def delete_worker(self, request: HttpRequest) -> Whole:
        try:
            worker = self.router.registry.remove(self._find(request))
        except (KeyError, ValueError) as exc:
            raise RequestError(404, str(exc).strip("'\"")) from None
        if self.router.replicator is not None:
            self.router.replicator.worker_removed(worker.url)
        if self.router.siblings is not None:
            self.router.siblings.worker_removed(worker.url)
        return json_reply({"removed": worker.url})

    async def openapi(self, request: HttpRequest) -> Whole:
        return json_reply(self.router.openapi_document)

    async def metrics_text(self, request: HttpRequest) -> Whole:
        return Whole(
            200, self.router.metrics.exposition(), {"content-type": "text/plain; version=0.0.4"}
        )


def _cards(body: bytes) -> list[dict[str, Any]] | None:
    """The cards of a worker's /v1/models answer (None: not such an answer)."""
    try:
        data = msgspec.json.decode(body).get("data")
    except (msgspec.DecodeError, AttributeError):
        return None
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else None
