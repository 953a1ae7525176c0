"""Continuous batching over MemPool: requests join and leave the running batch at step bounds.

Admission matches the prompt in MemPool (pinning the cached prefix, loading its pages on the
host tier back to the device) and allocates blocks for the rest, making room from
least-recently-used historical KV when memory runs short; each step prefills the admitted
requests (a long prompt one chunk a step, chunked prefill as SGLang does it) and decodes one
token for every running one in the same step (SGLang's --enable-mixed-chunk); a finished
request's prompt and output become historical KV through `insert` (context caching), and
the cache changes are published as KV events. Hooks (`RequestHooks`) take a request over on
submit or on finish, as one side of a disaggregated pair does; they call back through the
`Engine` methods (`enqueue`, `join_prefilled`, `retire`).

Nothing is lost when KV memory runs out (SGLang's retraction): before each step every running
request gets the block its next token's KV needs; when memory is short, running requests are
retracted, those that lose least first (fewest generated tokens, then the longest prompt),
until the rest fit. A retracted request keeps what it generated, leaves its computed pages
in the cache (where caching is on: with a host tier they move there rather than vanish),
and waits ahead of new work to prefill its prompt and output again, reusing whatever the
cache still holds; the new-token ratio jumps so that admission takes less. Only a request
that cannot fit even alone is aborted, with a message that says what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connector.worker.admission import Admission, TokenRatio
from connector.worker.backend import Backend
from connector.worker.hooks import RequestHooks
from connector.worker.kv_cache import KVCache
from connector.worker.lora import LoRAError, LoRARegistry
from connector.worker.protocol import BadRequest, GenerateInput, cache_fields
from connector.worker.sequence import DONE, TOKEN, Sequence
from mempool import InsertResult, PrefixMatch
from shared.namespaces import MIN_NAMESPACE_PAGE, CacheNamespace
from shared.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

__all__ = ["DONE", "TOKEN", "Scheduler", "SchedulerConfig", "SchedulerStats"]


@dataclass(slots=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_prefill_tokens: int = 16384  # new prompt tokens admitted per step (SGLang's name)
    enable_cache: bool = True  # False: SGLang's --disable-radix-cache
    chunked_prefill_size: int | None = None  # prompt tokens prefilled per step; None: all
    ratio: TokenRatio = field(default_factory=TokenRatio)  # SGLang's new-token ratio


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters the metrics endpoint and /get_server_info report."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens: loaded from the host tier
    written_back_tokens: int = 0  # of cached_tokens: from pages a decode wrote back here
    generation_tokens: int = 0
    aborted: int = 0
    # SGLang's retraction counters (sglang:num_retracted_*_total) and the last step's count.
    retracted: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    last_retracted: int = 0


class Scheduler:
    """Owns the waiting queue and the running batch; KV memory is `kv`'s."""

    def __init__(
        self,
        backend: Backend,
        kv: KVCache,
        tokenizer: ChatTokenizer,
        config: SchedulerConfig,
        hooks: RequestHooks | None = None,
        lora: LoRARegistry | None = None,
    ) -> None:
        self.backend = backend
        self.lora = lora if lora is not None else LoRARegistry()
        self.kv = kv
        self.tokenizer = tokenizer
        self.config = config
        self.hooks = hooks if hooks is not None else RequestHooks()
        self.admission = Admission(
            kv,
            config.max_running_requests,
            config.max_prefill_tokens,
            config.enable_cache,
            config.chunked_prefill_size,
            config.ratio,
            self.lora,
        )
        self.ratio = self.admission.ratio
        self.page = kv.page
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.chunked: Sequence | None = None  # its prompt is part prefilled (at most one)
        self.stats = SchedulerStats()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.on_first_token: Callable[[float], None] = lambda seconds: None
        self.on_finish: Callable[[float], None] = lambda seconds: None

    # ----------------------------------------------------------------- public

    async def start(self) -> None:
        await self.hooks.start()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        await self.hooks.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.kv.close()

    def submit(self, gen: GenerateInput) -> Sequence:
        """Queue a request; BadRequest when it can never run on this instance."""
        n = len(gen.input_ids)
        limit = self.backend.context_length
        if n >= limit:
            raise BadRequest(f"the prompt has {n} tokens; this model's context is {limit}")
        capacity = self.kv.request_capacity_blocks
        if -(-n // self.page) + 1 > capacity:
            raise BadRequest(
                f"the prompt has {n} tokens; this instance's KV cache holds {capacity * self.page}"
            )
        sampling = gen.sampling
        sampling.max_new_tokens = min(sampling.max_new_tokens, limit - n)
        seq = Sequence(gen.rid, gen.input_ids, sampling)
        seq.namespace, seq.lora = self.namespace(gen.extras)
        if not self.hooks.on_submit(seq, gen.extras, self):
            self.enqueue(seq)
        return seq

    def namespace(self, extras: dict[str, Any]) -> tuple[CacheNamespace | None, Any]:
        """The request's cache namespace and adapter; BadRequest for an adapter that is not
        loaded (SGLang's message) or a namespace on pages too small to key it safely."""
        fields = cache_fields(extras)
        ref = None
        if fields.adapter is not None:
            try:
                ref = self.lora.resolve(fields.adapter)
            except LoRAError as exc:
                raise BadRequest(str(exc)) from None
        if not fields.extra_key and fields.cache_salt is None and ref is None:
            return None, None
        if self.page < MIN_NAMESPACE_PAGE:
            raise BadRequest(
                f"extra_key, cache_salt and LoRA adapters need --page-size >= "
                f"{MIN_NAMESPACE_PAGE} on this worker (it has {self.page}): a smaller page "
                "is too short a key to keep cache namespaces apart"
            )
        ns = CacheNamespace(
            extra_key=fields.extra_key,
            lora_id=ref.lora_id if ref is not None else "",
            lora_name=ref.lora_name if ref is not None else None,
            cache_salt=fields.cache_salt,
            shared_prefix_tokens=fields.shared_prefix_tokens,
        )
        return ns, ref

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora is not None and seq.lora_held:
            self.lora.release(seq.lora)
            seq.lora_held = False

    def enqueue(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop a waiting request, finish a running one at the next step."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._release_lora(seq)
            self.stats.aborted += 1
            log.info("request %s aborted while waiting: the client disconnected", seq.rid)
        elif seq.finish_reason is None:
            seq.finish_reason = {"type": "abort", "message": "client disconnected"}
            log.info("request %s aborted while running: the client disconnected", seq.rid)

    def flush_cache(self) -> bool:
        """Drop all historical KV; refused (False) while requests wait or run, as in SGLang,
        and while cached pages are pinned (a PD push or write-back, a peer's pull)."""
        if self.waiting or self.running or self.chunked is not None or self.kv.pinned_pages:
            return False
        self.kv.flush()
        return True

    def load(self) -> dict[str, int]:
        """SGLang's /get_load entry for this (only) data-parallel rank."""
        return {
            "dp_rank": 0,
            "num_reqs": len(self.running) + (self.chunked is not None),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": self.kv.used_tokens,
            "num_pending_tokens": sum(len(s.prompt_ids) + s.fill_outputs for s in self.waiting),
        }

    def state(self) -> dict[str, Any]:
        """/get_server_info's `internal_states` entry: the load, the new-token ratio and the
        retractions, under SGLang's names."""
        load = self.load()
        return {
            **load,
            "num_running_reqs": load["num_reqs"],
            "num_queue_reqs": load["num_waiting_reqs"],
            "num_queue_tokens": load["num_pending_tokens"],
            "num_retracted_queue_reqs": sum(1 for s in self.waiting if s.resumed),
            "new_token_ratio": round(self.ratio.current, 6),
            "num_retracted_reqs": self.stats.retracted,
            "num_retracted_input_tokens": self.stats.retracted_input_tokens,
            "num_retracted_output_tokens": self.stats.retracted_output_tokens,
        }

    def kv_tiers(self) -> dict[str, Any]:
        """/get_server_info's `kv_tiers`: capacity, use and hits of the device and host tiers."""
        host = self.stats.host_cached_tokens
        return self.kv.tier_report(self.stats.cached_tokens - host, host)

    # ----------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running and self.chunked is None:
                self.ratio.reset()
                self._wake.clear()
                await self._wake.wait()
            self._finish_left()
            self._reserve_decodes()
            prefills = self._admit()
            decodes = list(self.running)
            if not prefills and not decodes:
                await asyncio.sleep(0.005)  # waiting for memory that running requests hold
                continue
            try:
                await self.backend.step(prefills, decodes)
            except Exception as exc:  # a model failure fails its requests, not the worker
                log.exception("model step failed")
                for seq in (*prefills, *decodes):
                    seq.finish_reason = {"type": "abort", "message": f"model error: {exc}"}
                    if seq.prefilled:
                        self.running.remove(seq)
                    if seq is self.chunked:
                        self.chunked = None
                    self._finish(seq, cache=False)
                continue
            now = time.perf_counter()
            prefilled = [seq for seq in prefills if seq.ends_prompt]  # the rest: chunks to go
            for seq in prefilled:
                if seq.resumed:  # its prefill brought it back where it was retracted
                    seq.prefilled = True
                else:
                    self._first_token(seq, now)
                    if seq.sampling.max_new_tokens == 0:
                        seq.output_ids.pop()  # a prefill-only request returns no token
                self.running.append(seq)
            for seq in (*prefilled, *decodes):
                self._after_step(seq)
            for seq in [s for s in self.running if s.finish_reason is not None]:
                self.running.remove(seq)
                self._finish(seq, cache=self.config.enable_cache)
            if self.config.enable_cache:
                for seq in prefills:
                    if seq.finish_reason is None:
                        self._cache_prompt(seq)
            self.kv.publish()
            await asyncio.sleep(0)  # let HTTP handlers run between steps, even when steps are free

    def _cache_prompt(self, seq: Sequence) -> None:
        """A prompt's computed whole pages enter the cache as soon as they are prefilled,
        pinned by the request (SGLang's cache_unfinished_req): requests sharing them hit at
        once, not only after this one finishes. Its answer is added when it finishes."""
        computed = seq.num_computed if seq.prefilled else seq.extend_from + seq.extend_len
        full, cached_pages = computed // self.page, seq.cached_tokens // self.page
        if full <= cached_pages:
            return
        if seq.reported_cached is None:  # the response reports what admission found
            seq.reported_cached = seq.report_cached
        adopt = seq.blocks[: full - cached_pages]
        try:
            pinned = self.kv.keep_pinned(seq, full, adopt)
        except Exception:  # not cached early: it still is when it finishes
            log.exception("caching the prompt of request %s failed", seq.rid)
            return
        # The index holds these pages now (or its own copies of them): the request reads
        # them as its prefix, locked by the insert, instead of owning them.
        addrs = self.kv.lookup(seq.all_ids[: full * self.page], seq.namespace)
        if seq.prefix is not None:
            self.kv.release(seq.prefix)
        seq.prefix = PrefixMatch(addrs, full * self.page, pinned.node, True)
        seq.blocks = seq.blocks[full - cached_pages :]
        seq.cached_tokens = full * self.page

    def _finish_left(self) -> None:
        """Running requests whose client left finish before the step (they get no token)."""
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self.running.remove(seq)
            self._finish(seq, cache=self.config.enable_cache)

    def _reserve_decodes(self) -> None:
        """Give each running request the block its next token's KV needs; retract running
        requests (SGLang's order: fewest generated tokens, then longest prompt, go first)
        until the others fit. The new-token ratio decays at a step that retracted none and
        is raised at one that did."""
        if not self.running:
            return
        keep = sorted(
            self.running, key=lambda s: (len(s.output_ids), -len(s.prompt_ids)), reverse=True
        )
        retracted: list[Sequence] = []
        i = 0
        while i < len(keep):
            if self._grow(keep[i], ahead=1):
                i += 1
            elif len(keep) > 1:  # (the one retracted may be keep[i] itself: the loop ends)
                retracted.append(keep.pop())
                self._retract(retracted[-1])
            elif self.chunked is not None:  # the last one left: a half-prefilled prompt yields
                chunked, self.chunked = self.chunked, None
                self._retract(chunked)
                retracted.append(chunked)
            elif self._fits_alone(keep[-1]):  # pinned by transfers or pulls: wait for them
                retracted.append(keep.pop())
                self._retract(retracted[-1])
            else:
                self._abort_alone(keep.pop())
        self.stats.last_retracted = len(retracted)
        if retracted:
            for seq in sorted(retracted, key=lambda s: s.arrival, reverse=True):
                self.waiting.appendleft(seq)  # ahead of new work, the earliest first
            self.ratio.after_retract(self.running)
            log.warning(
                "KV cache full: retracted %d requests, new-token ratio now %.3f",
                len(retracted),
                self.ratio.current,
            )
        else:
            self.ratio.step()

    def _retract(self, seq: Sequence) -> None:
        """Free `seq`'s KV and make it wait to prefill again with what it generated; its
        computed whole pages stay as cache (when caching is on) for that prefill to reuse."""
        if seq in self.running:
            self.running.remove(seq)
        computed = seq.num_computed if seq.prefilled else seq.extend_from + seq.extend_len
        self.stats.retracted += 1
        self.stats.retracted_input_tokens += len(seq.prompt_ids)
        self.stats.retracted_output_tokens += len(seq.output_ids)
        free = seq.blocks
        cached_pages, full = seq.cached_tokens // self.page, computed // self.page
        if self.config.enable_cache and full > cached_pages:
            adopt, free = seq.blocks[: full - cached_pages], seq.blocks[full - cached_pages :]
            try:
                self.kv.keep(seq, full, adopt)
            except Exception:  # caching failed: free everything, never leak
                log.exception("caching retracted request %s failed", seq.rid)
                free = seq.blocks
        self.kv.free(free)
        seq.blocks = []
        if seq.prefix is not None:
            self.kv.release(seq.prefix)
            seq.prefix = None
        self.backend.retract(seq)
        self._release_lora(seq)
        if seq.reported_cached is None:  # the response reports the first admission's hit
            seq.reported_cached = seq.report_cached
        seq.retractions += 1
        seq.fill_outputs = len(seq.output_ids)
        seq.cached_tokens = seq.host_cached_tokens = seq.preloaded = 0
        seq.extend_from = seq.extend_len = 0
        seq.prefilled = False

    def _fits_alone(self, seq: Sequence) -> bool:
        """`seq` with its next token fits the request tier once nothing else holds it: the
        pages that block it now are pinned for a while (a PD push or write-back in flight, a
        KV arrival not yet joined, a peer's pull), so it waits rather than ends."""
        return self._tokens_needed(seq) <= self.kv.capacity_tokens

    def _tokens_needed(self, seq: Sequence) -> int:
        """The KV, in whole pages' tokens, of `seq`'s computed tokens and its next one."""
        return -(-(seq.num_computed + 1) // self.page) * self.page

    def _abort_alone(self, seq: Sequence) -> None:
        """Every other request is retracted and `seq` still has no block for its next token."""
        self.running.remove(seq)
        need = self._tokens_needed(seq)
        seq.finish_reason = {
            "type": "abort",
            "message": f"out of KV cache memory: this request needs {need} tokens of KV and "
            f"this worker holds {self.kv.capacity_tokens} "
            f"({self.kv.pinned_pages * self.page} of them pinned by transfers), with every "
            "other request retracted",
        }
        log.warning("request %s aborted: %s", seq.rid, seq.finish_reason["message"])
        self._finish(seq, cache=self.config.enable_cache)

    def _admit(self) -> list[Sequence]:
        """This step's prefills; requests that can never fit end here."""
        chunked = self.chunked
        if chunked is not None and chunked.finish_reason is not None:  # aborted mid-prompt
            self.chunked = None
            self._finish(chunked, cache=False)
        step = self.admission.admit(self.waiting, self.running, self.chunked)
        self.chunked = step.chunked
        for seq in step.refused:
            self._release_lora(seq)
            need = len(seq.prompt_ids) + seq.fill_outputs
            seq.finish_reason = {
                "type": "abort",
                "message": f"out of KV cache memory: the prompt needs {need} tokens of KV and "
                f"this worker holds {self.kv.capacity_tokens} "
                f"({self.kv.pinned_pages * self.page} of them pinned by transfers)",
            }
            self.stats.aborted += 1
            log.warning("request %s refused: %s", seq.rid, seq.finish_reason["message"])
            seq.events.put_nowait(DONE)
        for seq in step.new:
            if not seq.resumed:
                self._count(seq)
        return step.prefills

    def _count(self, seq: Sequence) -> None:
        self.stats.requests += 1
        self.stats.prompt_tokens += len(seq.prompt_ids)
        self.stats.cached_tokens += seq.report_cached
        self.stats.host_cached_tokens += seq.host_cached_tokens
        self.stats.written_back_tokens += seq.written_back_tokens

    def _first_token(self, seq: Sequence, now: float) -> None:
        seq.prefilled = True
        seq.first_token_at = now
        self.on_first_token(now - seq.arrival)

    def _after_step(self, seq: Sequence) -> None:
        """A new token: is the request done; tell the client."""
        if seq.finish_reason is None:
            self._check_finish(seq)
        seq.events.put_nowait(TOKEN)

    def join_prefilled(self, seq: Sequence) -> None:
        """A request whose prompt KV and first token came from elsewhere (a prefill
        instance) joins the running batch as if this instance had prefilled it."""
        self._first_token(seq, time.perf_counter())
        self._count(seq)
        self.running.append(seq)
        self._after_step(seq)
        if seq.finish_reason is not None:
            self.running.remove(seq)
            self._finish(seq, cache=self.config.enable_cache)
        self._wake.set()

    def _grow(self, seq: Sequence, ahead: int = 0) -> bool:
        """Own a block for every page holding computed KV and the KV of the next `ahead`
        tokens (one more page every page_size tokens); False when memory is short."""
        owned = seq.cached_tokens // self.page + len(seq.blocks)
        missing = -(-(seq.num_computed + ahead) // self.page) - owned
        if missing <= 0:
            return True
        blocks = self.kv.alloc(missing)
        if blocks is None:
            return False
        seq.blocks.extend(blocks)
        return True

    def _check_finish(self, seq: Sequence) -> None:
        sampling, out = seq.sampling, seq.output_ids
        if sampling.max_new_tokens == 0:
            seq.finish_reason = {"type": "length", "length": 0}
            return
        token = out[-1]
        eos = not sampling.ignore_eos and token in self.backend.eos_token_ids
        if eos or token in sampling.stop_token_ids:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif sampling.stop and (hit := self._stop_string(seq)) is not None:
            seq.finish_reason = {"type": "stop", "matched": hit}
        elif len(out) >= sampling.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": sampling.max_new_tokens}

    def _stop_string(self, seq: Sequence) -> str | None:
        text = self.tokenizer.decode(seq.output_ids)
        return next((s for s in seq.sampling.stop if s and s in text), None)

    # ----------------------------------------------------------------- finishing

    def _finish(self, seq: Sequence, cache: bool) -> None:
        """Turn the request's KV into historical KV (insert), free the rest, wake the client;
        unless a hook takes the request over (a disaggregated one hands its KV on first)."""
        if self.hooks.on_finish(seq, cache, self):
            return
        cached_pages = seq.cached_tokens // self.page
        full = seq.num_computed // self.page if seq.prefilled else 0
        new_pages = full - cached_pages if cache and full > cached_pages else 0
        adopt, rest = seq.blocks[:new_pages], seq.blocks[new_pages:]
        if adopt:
            try:
                self.kv.keep(seq, full, adopt)
            except Exception:  # caching failed: free everything, never leak
                log.exception("caching request %s failed", seq.rid)
                rest = seq.blocks
        self.retire(seq, rest)

    def retire(self, seq: Sequence, free: list[int], pinned: InsertResult | None = None) -> None:
        """Free what the request still owns, unpin its prefix, wake the client."""
        self.kv.free(free)
        seq.blocks = []
        if seq.prefix is not None:
            self.kv.release(seq.prefix)
            seq.prefix = None
        if pinned is not None:
            self.kv.release(pinned)
        self.backend.release(seq)
        self._release_lora(seq)
        self.stats.generation_tokens += len(seq.output_ids)
        self.on_finish(time.perf_counter() - seq.arrival)
        if seq.finish_reason and seq.finish_reason.get("type") == "abort":
            self.stats.aborted += 1
        seq.events.put_nowait(DONE)
