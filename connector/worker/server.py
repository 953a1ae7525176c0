"""The worker's HTTP surface, as an SGLang server serves it (native and OpenAI-compatible).

Bad input gets HTTP 400 with a JSON body `{"object": "error", "message", "type", "code"}` and
the worker keeps serving; a client that disconnects mid-stream has its request aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from connector.worker.lora import LoRAError, LoRARef
from connector.worker.protocol import (
    BadRequest,
    GenerateInput,
    check_vocab,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_sampling,
)
from connector.worker.scheduler import Scheduler
from connector.worker.sequence import DONE, Sequence
from shared.http_errors import json_error
from shared.openapi import worker_document
from shared.token_cache import CachedEncoder
from shared.tokenizer import ChatTokenizer, IncrementalDecoder, PromptEncoder

log = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass
class WorkerInfo:
    """What /get_model_info, /get_server_info and /v1/models report."""

    model_path: str
    served_model_name: str
    server_args: dict[str, Any]


class KVHandOffFailed(Exception):
    """A disaggregated request whose KV never moved (the other side failed or vanished)."""


@web.middleware
async def errors_as_json(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal is JSON; nothing a client sends makes the worker answer 500 or crash."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return json_error(400, str(exc))
    except KVHandOffFailed as exc:
        return json_error(502, str(exc), "KVTransferError")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return json_error(exc.status, exc.reason, type(exc).__name__)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("unexpected error on %s", request.path)
        return json_error(500, f"internal error: {exc}", "InternalServerError")


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def trimmed_text(tokenizer: ChatTokenizer, seq: Sequence) -> str:
    """The output text; a matched stop string and what follows it are cut, as SGLang does."""
    text = tokenizer.decode(seq.output_ids)
    reason = seq.finish_reason or {}
    matched = reason.get("matched")
    if reason.get("type") == "stop" and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


class WorkerMetrics:
    """Prometheus metrics under SGLang's names, read from the scheduler at scrape time."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.scheduler = scheduler
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token",
            labels,
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        scheduler.on_first_token = self.ttft.labels(model_name).observe
        scheduler.on_finish = self.e2e.labels(model_name).observe
        self.registry.register(self)

    def collect(self):  # prometheus_client custom collector protocol
        s, stats = self.scheduler, self.scheduler.stats
        labels = [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        used, total = s.kv.used_tokens, s.kv.capacity_tokens
        yield counter("sglang:num_requests", "Requests admitted", stats.requests)
        yield counter("sglang:prompt_tokens", "Prompt tokens", stats.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens", stats.generation_tokens)
        if s.kv.tiered:  # SGLang's split by where the hit was found
            cached = CounterMetricFamily(
                "sglang:cached_tokens",
                "Prompt tokens served from cache",
                labels=["model_name", "cache_source"],
            )
            host = stats.host_cached_tokens
            cached.add_metric([*labels, "device"], stats.cached_tokens - host)
            cached.add_metric([*labels, "host"], host)
            yield cached
            host_used, host_total = s.kv.host_tokens()
            yield gauge("sglang:hicache_host_used_tokens", "Host tier tokens in use", host_used)
            yield gauge("sglang:hicache_host_total_tokens", "Host tier capacity", host_total)
        else:
            yield counter(
                "sglang:cached_tokens", "Prompt tokens served from cache", stats.cached_tokens
            )
        yield counter(
            "memserve:written_back_cached_tokens",
            "Of the cached prompt tokens: those on pages a decode instance wrote back here",
            stats.written_back_tokens,
        )
        yield counter("sglang:num_aborted_requests", "Aborted requests", stats.aborted)
        yield counter(
            "sglang:num_retracted_requests",
            "Retracted requests (KV given up, requeued)",
            stats.retracted,
        )
        yield counter(
            "sglang:num_retracted_input_tokens",
            "Prompt tokens of retracted requests",
            stats.retracted_input_tokens,
        )
        yield counter(
            "sglang:num_retracted_output_tokens",
            "Output tokens generated before a retraction (kept, not lost)",
            stats.retracted_output_tokens,
        )
        yield gauge(
            "sglang:num_retracted_reqs", "Requests retracted at the last step", stats.last_retracted
        )
        yield gauge(
            "sglang:new_token_ratio",
            "Expected share of max_new_tokens still to generate (admission)",
            s.ratio.current,
        )
        queued = s.load()
        yield gauge(
            "memserve:num_queue_tokens",
            "Prompt tokens waiting (retracted ones with their output)",
            queued["num_pending_tokens"],
        )
        yield counter("memserve:evicted_blocks", "KV blocks evicted", s.kv.evicted_blocks)
        yield gauge("sglang:num_running_reqs", "Running requests", len(s.running))
        yield gauge("sglang:num_queue_reqs", "Waiting requests", len(s.waiting))
        yield gauge("sglang:token_usage", "Fraction of KV blocks in use", used / max(total, 1))
        hit = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        yield gauge("sglang:cache_hit_rate", "Cached / prompt tokens so far", hit)


class WorkerServer:
    """Routes of one worker; `app()` builds the aiohttp application."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: ChatTokenizer,
        info: WorkerInfo,
        encoder: PromptEncoder | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.encoder = encoder or tokenizer  # prompts -> ids (the exact cache, if enabled)
        self.info = info
        self.metrics = WorkerMetrics(scheduler, info.served_model_name)

    def app(self, max_body: int = 512 * 1024 * 1024) -> web.Application:
        app = web.Application(middlewares=[errors_as_json], client_max_size=max_body)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_load", self.loads)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics_text)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/openapi.json", self.openapi)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        await self.scheduler.start()

    async def _stop(self, app: web.Application) -> None:
        await self.scheduler.stop()

    # ----------------------------------------------------------------- generation

    def _meta(self, seq: Sequence, finished: bool) -> dict[str, Any]:
        return {
            "id": seq.rid,
            "finish_reason": seq.finish_reason if finished else None,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": seq.report_cached,
            "cached_tokens_details": seq.cached_tokens_details,
            "pulled_tokens": seq.pulled_tokens,
            "written_back_tokens": seq.written_back_tokens,
            "e2e_latency": time.perf_counter() - seq.arrival,
        }

    async def _run(self, gen: GenerateInput) -> Sequence:
        """Submit and wait for the finish (non-streaming)."""
        seq = self.scheduler.submit(gen)
        try:
            while await seq.events.get() != DONE:
                pass
        except asyncio.CancelledError:
            self.scheduler.abort(seq)
            raise
        if seq.handoff_error is not None:
            raise KVHandOffFailed(f"bootstrap_room {seq.room}: {seq.handoff_error}")
        return seq

    async def _stream(
        self,
        request: web.Request,
        gen: GenerateInput,
        chunk: Callable[[Sequence, str, bool], list[dict[str, Any]]],
    ) -> web.StreamResponse:
        """SSE: one event per step with the text delta, then the final chunk and [DONE]."""
        seq = self.scheduler.submit(gen)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        decoder = IncrementalDecoder(self.tokenizer)
        first = None
        try:
            if seq.room is not None:  # a KV hand-off failing before any token: an HTTP error
                first = await seq.events.get()
                if first == DONE and seq.handoff_error is not None:
                    raise KVHandOffFailed(f"bootstrap_room {seq.room}: {seq.handoff_error}")
            await response.prepare(request)
            finished = False
            while not finished:
                event, first = first if first is not None else await seq.events.get(), None
                finished = event == DONE
                while not finished and not seq.events.empty():  # coalesce steps we fell behind
                    finished = seq.events.get_nowait() == DONE
                if finished:
                    delta = decoder.finish(trimmed_text(self.tokenizer, seq))
                else:
                    delta = decoder.update(seq.output_ids)
                for body in chunk(seq, delta, finished):
                    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.scheduler.abort(seq)
            raise
        return response

    async def generate(self, request: web.Request) -> web.StreamResponse:
        gen = parse_generate(await read_json(request), self.encoder)
        check_vocab("input_ids", gen.input_ids, self.tokenizer.vocab_size)
        if gen.stream:

            def chunk(seq: Sequence, delta: str, finished: bool) -> list[dict[str, Any]]:
                text = (
                    trimmed_text(self.tokenizer, seq)
                    if finished
                    else self.tokenizer.decode(seq.output_ids)
                )
                return [
                    {
                        "text": text,
                        "output_ids": list(seq.output_ids),
                        "meta_info": self._meta(seq, finished),
                    }
                ]

            return await self._stream(request, gen, chunk)
        seq = await self._run(gen)
        return web.json_response(
            {
                "text": trimmed_text(self.tokenizer, seq),
                "output_ids": seq.output_ids,
                "meta_info": self._meta(seq, True),
            }
        )

    @staticmethod
    def _openai_finish(seq: Sequence) -> str | None:
        reason = (seq.finish_reason or {}).get("type")  # stop, length, abort: OpenAI's names
        return None if reason is None else str(reason)

    def _usage(self, seq: Sequence) -> dict[str, Any]:
        prompt, completion = len(seq.prompt_ids), len(seq.output_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": seq.report_cached,
                "pulled_tokens": seq.pulled_tokens,
                "written_back_tokens": seq.written_back_tokens,
            },
        }

    async def _openai(
        self,
        request: web.Request,
        gen: GenerateInput,
        include_usage: bool,
        kind: str,
        stream_choice: Callable[[Sequence, str, str | None], dict[str, Any] | None],
        final_choice: Callable[[Sequence, str], dict[str, Any]],
    ) -> web.StreamResponse:
        """An OpenAI-shaped answer: one object, or chunks plus an optional usage chunk."""
        prefix, chunk_kind = {
            "chat": ("chatcmpl", "chat.completion.chunk"),
            "text": ("cmpl", "text_completion"),
        }[kind]
        base = {
            "id": f"{prefix}-{gen.rid}",
            "created": int(time.time()),
            "model": self.info.served_model_name,
        }
        if gen.stream:

            def chunk(seq: Sequence, delta: str, finished: bool) -> list[dict[str, Any]]:
                choice = stream_choice(seq, delta, self._openai_finish(seq) if finished else None)
                out = (
                    [] if choice is None else [{**base, "object": chunk_kind, "choices": [choice]}]
                )
                if finished and include_usage:
                    out.append(
                        {**base, "object": chunk_kind, "choices": [], "usage": self._usage(seq)}
                    )
                return out

            return await self._stream(request, gen, chunk)
        seq = await self._run(gen)
        choice = {
            "index": 0,
            **final_choice(seq, trimmed_text(self.tokenizer, seq)),
            "logprobs": None,
            "finish_reason": self._openai_finish(seq),
        }
        return web.json_response(
            {
                **base,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": [choice],
                "usage": self._usage(seq),
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        gen, include_usage = parse_chat(await read_json(request), self.encoder)
        started = False

        def stream_choice(seq: Sequence, delta: str, finish: str | None) -> dict[str, Any] | None:
            nonlocal started
            message: dict[str, Any] = {"content": delta}
            if not started:
                message["role"] = "assistant"
                started = True
            if not (delta or finish or "role" in message):
                return None
            return {"index": 0, "delta": message, "logprobs": None, "finish_reason": finish}

        return await self._openai(
            request,
            gen,
            include_usage,
            "chat",
            stream_choice,
            lambda seq, text: {"message": {"role": "assistant", "content": text}},
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        gen, include_usage = parse_completion(await read_json(request), self.encoder)
        check_vocab("prompt", gen.input_ids, self.tokenizer.vocab_size)
        return await self._openai(
            request,
            gen,
            include_usage,
            "text",
            lambda seq, delta, finish: {
                "index": 0,
                "text": delta,
                "logprobs": None,
                "finish_reason": finish,
            },
            lambda seq, text: {"text": text},
        )

    # ----------------------------------------------------------------- management

    async def models(self, request: web.Request) -> web.Response:
        """The served model, then each loaded adapter as SGLang lists it (its `parent` the
        base model; requests name it as `model: "base:adapter"` or `lora_path`)."""
        now = int(time.time())
        base = self.info.served_model_name
        cards = [
            {
                "id": base,
                "object": "model",
                "created": now,
                "owned_by": "sglang",
                "root": self.info.model_path,
                "parent": None,
                "max_model_len": self.scheduler.backend.context_length,
            }
        ]
        for name, path in self.scheduler.lora.loaded_adapters().items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "sglang",
                    "root": path,
                    "parent": base,
                    "max_model_len": None,
                }
            )
        return web.json_response({"object": "list", "data": cards})

    def _lora_reply(self, error: str | None) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 on success, 400 with `error_message` otherwise."""
        body = {
            "success": error is None,
            "error_message": error,
            "loaded_adapters": self.scheduler.lora.loaded_adapters(),
        }
        return web.json_response(body, status=200 if error is None else 400)

    @staticmethod
    def _lora_body(body: Any, fields: dict[str, type]) -> dict[str, Any]:
        """A LoRA endpoint's JSON object, its fields type-checked (BadRequest: a 400)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        out: dict[str, Any] = {}
        for name, kind in fields.items():
            value = body.get(name)
            if kind is str and (not isinstance(value, str) or not value):
                raise BadRequest(f"'{name}' must be a non-empty string")
            if kind is bool:
                value = False if value is None else value
                if not isinstance(value, bool):
                    raise BadRequest(f"'{name}' must be true or false")
            out[name] = value
        return out

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's POST /load_lora_adapter {lora_name, lora_path, pinned}: registered and
        loaded (the sim sleeps the modelled load)."""
        raw = self._lora_body(
            await read_json(request), {"lora_name": str, "lora_path": str, "pinned": bool}
        )
        ref = LoRARef(raw["lora_name"], raw["lora_path"], raw["pinned"])
        try:
            self.scheduler.lora.register(ref)
        except LoRAError as exc:
            return self._lora_reply(str(exc))
        seconds = self.scheduler.backend.lora_load_s()
        if seconds > 0:
            await asyncio.sleep(seconds)
        return self._lora_reply(None)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's POST /unload_lora_adapter {lora_name}: new requests can no longer name
        it; running ones finish with it. Its cached KV stays until evicted, unreachable (a
        reload gets a new lora_id, so a new namespace)."""
        raw = self._lora_body(await read_json(request), {"lora_name": str})
        try:
            self.scheduler.lora.unregister(raw["lora_name"])
        except LoRAError as exc:
            return self._lora_reply(str(exc))
        return self._lora_reply(None)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token end to end; 503 if the engine cannot within 20 s."""
        token = self.tokenizer.eos_token_id or 0
        gen = GenerateInput(
            [token], parse_sampling({"max_new_tokens": 1}), False, f"health-{uuid.uuid4().hex}"
        )
        try:
            await asyncio.wait_for(self._run(gen), timeout=20)
        except TimeoutError:
            return json_error(503, "health generation timed out", "ServiceUnavailable")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.info.model_path,
                "tokenizer_path": str(self.tokenizer.path),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        kv = self.scheduler.kv
        return web.json_response(
            {
                **self.info.server_args,
                "version": f"memserve-worker {VERSION}",
                "context_length": self.scheduler.backend.context_length,
                "page_size": kv.page,
                "max_total_num_tokens": kv.capacity_tokens,  # the device tier's
                "kv_tiers": self.scheduler.kv_tiers(),
                "backend": self.scheduler.backend.info(),
                "mempool": kv.stats(),
                "disaggregation": self.scheduler.hooks.info(),
                **self.scheduler.hooks.server_info(),
                "lora": self.scheduler.lora.info(),
                "internal_states": [self.scheduler.state()],
                **(
                    {"tokenizer_cache": self.encoder.stats()}
                    if isinstance(self.encoder, CachedEncoder)
                    else {}
                ),
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.scheduler.flush_cache():
            if isinstance(self.encoder, CachedEncoder):  # (--tokenizer-cache) forgets too
                self.encoder.clear()
            return web.Response(text="Cache flushed.\n")
        return json_error(
            400,
            "cache not flushed: the worker is busy (requests are running or waiting, or "
            "cached KV is pinned by a transfer); try again when it is idle",
        )

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response([self.scheduler.load()])

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(worker_document(VERSION))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string")
        ids = self.tokenizer.encode(prompt)
        return web.json_response({"tokens": ids, "count": len(ids)})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise BadRequest("'tokens' must be a list of token ids")
        check_vocab("tokens", tokens, self.tokenizer.vocab_size)
        return web.json_response({"text": self.tokenizer.decode(tokens)})
