"""Continuous batching over MemPool: requests join and leave the running batch at step bounds.

Admission matches the prompt in MemPool (locking the cached prefix) and allocates blocks for
the rest, evicting least-recently-used historical KV when memory runs short; each step
prefills the admitted requests and decodes one token for every running one; a finished
request's prompt and output become historical KV through `insert` (context caching), and
the cache changes are published as KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from connector.kv_events import KVEventPublisher, page_hashes
from connector.tokenizer import ChatTokenizer
from connector.worker.backend import Backend
from connector.worker.pd import Arrival, PDLink, PDMode, bootstrap_fields
from connector.worker.protocol import BadRequest, GenerateInput
from connector.worker.sequence import Sequence
from mempool import InsertFlags, MemPool, OutOfBlocks, PrefixMatch
from mempool.radix import InsertResult

log = logging.getLogger(__name__)

TOKEN, DONE = "token", "done"


@dataclass(slots=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_prefill_tokens: int = 16384  # new prompt tokens admitted per step (SGLang's name)
    enable_cache: bool = True  # False: SGLang's --disable-radix-cache


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters the metrics endpoint and /get_server_info report."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    evicted_blocks: int = 0
    aborted: int = 0


class Scheduler:
    """Owns the waiting queue, the running batch and the worker's MemPool."""

    def __init__(
        self,
        backend: Backend,
        pool: MemPool,
        tokenizer: ChatTokenizer,
        config: SchedulerConfig,
        events: KVEventPublisher | None = None,
        pd: PDLink | None = None,
    ) -> None:
        self.backend = backend
        self.pd = pd  # prefill/decode disaggregation, when this instance is one side of it
        if pd is not None:
            pd.allocate = self._alloc_for_peer
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config
        self.events = events
        self.page = pool.spec.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._wake = asyncio.Event()
        self._hash_of_block: dict[int, int] = {}  # historical block -> page hash (events)
        self._task: asyncio.Task | None = None
        self.on_first_token: Callable[[float], None] = lambda seconds: None
        self.on_finish: Callable[[float], None] = lambda seconds: None

    # ----------------------------------------------------------------- public

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, gen: GenerateInput) -> Sequence:
        """Queue a request; BadRequest when it can never run on this instance."""
        n = len(gen.input_ids)
        limit = self.backend.context_length
        if n >= limit:
            raise BadRequest(f"the prompt has {n} tokens; this model's context is {limit}")
        capacity = self.pool.allocators[next(iter(self.pool.allocators))].num_blocks
        if -(-n // self.page) + 1 > capacity:
            raise BadRequest(
                f"the prompt has {n} tokens; this instance's KV cache holds {capacity * self.page}"
            )
        sampling = gen.sampling
        sampling.max_new_tokens = min(sampling.max_new_tokens, limit - n)
        try:
            room = bootstrap_fields(gen.extras) if self.pd is not None else None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        seq = Sequence(gen.rid, gen.input_ids, sampling)
        if room is not None:
            mode = self.pd.config.mode  # type: ignore[union-attr]
            if mode is PDMode.PREFILL:  # as SGLang's prefill: the first token only
                sampling.max_new_tokens = min(sampling.max_new_tokens, 1)
            if not self.pd.fake:  # type: ignore[union-attr]  (fake: each side computes alone)
                seq.room = room[0]
                if mode is PDMode.DECODE:
                    self.pd.spawn(self._receive(seq, *room))  # type: ignore[union-attr]
                    return seq
        self.waiting.append(seq)
        self._wake.set()
        return seq

    async def _receive(self, seq: Sequence, room: int, host: str, port: int | None) -> None:
        """Decode side: wait for the prefill's KV of `room`, then decode from its token."""
        try:
            arrival = await self.pd.receive(room, host, port)  # type: ignore[union-attr]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            seq.handoff_error = str(exc)
            seq.finish_reason = {"type": "abort", "message": str(exc)}
            seq.events.put_nowait(DONE)
            return
        if seq.finish_reason is not None:  # the client left while the KV travelled
            self.pd.free_received(arrival.received)  # type: ignore[union-attr]
            seq.events.put_nowait(DONE)
            return
        try:
            self._adopt(seq, arrival)
        except Exception as exc:
            self.pd.free_received(arrival.received)  # type: ignore[union-attr]
            seq.prefix, seq.blocks = None, []
            seq.handoff_error = f"bad KV arrival: {exc}"
            seq.finish_reason = {"type": "abort", "message": seq.handoff_error}
            seq.events.put_nowait(DONE)
            return
        self._wake.set()

    def _adopt(self, seq: Sequence, arrival: Arrival) -> None:
        """A decode request whose prompt KV arrived: it joins the batch already prefilled."""
        got = arrival.received
        n = len(seq.prompt_ids)
        if got.num_tokens != n:
            raise ValueError(f"{got.num_tokens} tokens of KV arrived for a {n}-token prompt")
        whole = n // self.page if got.inserted else 0
        if got.inserted:
            seq.prefix = PrefixMatch(got.addrs[:whole], whole * self.page, got.lock.node, True)  # type: ignore[union-attr]
        seq.blocks = list(got.addrs[whole:])
        seq.cached_tokens = whole * self.page
        seq.preloaded = n
        seq.reported_cached = arrival.prefill_cached
        seq.prefill_id = arrival.prefill_id
        seq.output_ids.append(arrival.first_token)
        seq.prefilled = True
        seq.first_token_at = time.perf_counter()
        self.on_first_token(seq.first_token_at - seq.arrival)
        self.stats.requests += 1
        self.stats.prompt_tokens += n
        self.stats.cached_tokens += arrival.prefill_cached
        self.running.append(seq)
        self._check_finish(seq)
        if seq.finish_reason is None and not self._grow(seq):
            seq.finish_reason = {"type": "abort", "message": "out of KV cache memory"}
        seq.events.put_nowait(TOKEN)
        if seq.finish_reason is not None:
            self.running.remove(seq)
            self._finish(seq, cache=self.config.enable_cache)

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop a waiting request, finish a running one at the next step."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.stats.aborted += 1
        elif seq.finish_reason is None:
            seq.finish_reason = {"type": "abort", "message": "client disconnected"}

    def flush_cache(self) -> bool:
        """Drop all historical KV; refused (False) while requests wait or run, as in SGLang."""
        if self.waiting or self.running:
            return False
        self.pool.flush()
        self._hash_of_block.clear()
        if self.events is not None:
            self.events.cleared()
            self.events.flush()
        return True

    def load(self) -> dict[str, int]:
        """SGLang's /get_load entry for this (only) data-parallel rank."""
        used = sum(t["used"] for t in self.pool.stats()["tiers"].values())
        return {
            "dp_rank": 0,
            "num_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": used * self.page,
            "num_pending_tokens": sum(len(s.prompt_ids) for s in self.waiting),
        }

    # ----------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
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
                    self._finish(seq, cache=False)
                continue
            now = time.perf_counter()
            for seq in prefills:
                seq.prefilled = True
                seq.first_token_at = now
                self.on_first_token(now - seq.arrival)
                if seq.sampling.max_new_tokens == 0:
                    seq.output_ids.pop()  # a prefill-only request returns no token
                self.running.append(seq)
            for seq in (*prefills, *decodes):
                if seq.finish_reason is None:
                    self._check_finish(seq)
                if seq.finish_reason is None and not self._grow(seq):
                    seq.finish_reason = {"type": "abort", "message": "out of KV cache memory"}
                seq.events.put_nowait(TOKEN)
            for seq in [s for s in self.running if s.finish_reason is not None]:
                self.running.remove(seq)
                self._finish(seq, cache=self.config.enable_cache)
            if self.events is not None:
                self.events.flush()
            await asyncio.sleep(0)  # let HTTP handlers run between steps, even when steps are free

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            seq = self.waiting[0]
            prompt = seq.prompt_ids
            if self.config.enable_cache:
                match = self.pool.match(prompt, lock=True)
                # Keep at least one prompt token to compute: its logits give the first token.
                usable = min(match.num_tokens, len(prompt) - 1) // self.page
                match.addrs = match.addrs[:usable]
            else:
                match, usable = None, 0
            new_tokens = len(prompt) - usable * self.page
            blocks = None
            if not admitted or new_tokens <= budget:
                blocks = self._alloc(-(-len(prompt) // self.page) - usable)
            if blocks is None:
                if match is not None:
                    self.pool.release(match)
                if not admitted and not self.running:
                    self.waiting.popleft()  # nothing holds memory: this one can never fit
                    seq.finish_reason = {"type": "abort", "message": "out of KV cache memory"}
                    seq.events.put_nowait(DONE)
                    continue
                break
            self.waiting.popleft()
            seq.prefix, seq.cached_tokens, seq.blocks = match, usable * self.page, blocks
            budget -= new_tokens
            self.stats.requests += 1
            self.stats.prompt_tokens += len(prompt)
            self.stats.cached_tokens += seq.cached_tokens
            admitted.append(seq)
        return admitted

    def _alloc_for_peer(self, count: int, mem_type: object = None) -> list[int]:
        """Blocks for KV a peer sends: evicting cache like any request; OutOfBlocks if held."""
        blocks = self._alloc(count)
        if blocks is None:
            raise OutOfBlocks(
                f"{count} blocks for incoming KV: every block is held by running requests"
            )
        return blocks

    def _alloc(self, count: int) -> list[int] | None:
        """`count` blocks, evicting historical KV if needed; None if memory is held by requests."""
        if count <= 0:
            return []
        try:
            return self.pool.alloc_blocks(count)
        except OutOfBlocks:
            pass
        freed = self.pool.evict(count)
        self.stats.evicted_blocks += len(freed)
        if self.events is not None:
            self.events.removed(
                self._hash_of_block.pop(a) for a in freed if a in self._hash_of_block
            )
        try:
            return self.pool.alloc_blocks(count)
        except OutOfBlocks:
            return None

    def _grow(self, seq: Sequence) -> bool:
        """Own a block for every page holding computed KV (one more page every page_size tokens)."""
        owned = seq.cached_tokens // self.page + len(seq.blocks)
        missing = -(-seq.num_computed // self.page) - owned
        if missing <= 0:
            return True
        blocks = self._alloc(missing)
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

    def _finish(self, seq: Sequence, cache: bool) -> None:
        """Turn the request's KV into historical KV (insert), free the rest, wake the client.

        A disaggregated request hands its KV on first: a prefill pushes the prompt to its
        decode instance, a PD-Caching-3 decode writes its KV back to the prefill instance;
        the blocks stay pinned until that transfer ends.
        """
        ok = seq.prefilled and (seq.finish_reason or {}).get("type") != "abort"
        prefill_side = self.pd is not None and self.pd.config.mode is PDMode.PREFILL
        if not ok and seq.room is not None and prefill_side:  # the decode stops waiting now
            why = (seq.finish_reason or {}).get("message") or "the prefill did not finish"
            self.pd.fail_room(seq.room, why)  # type: ignore[union-attr]
        if ok and seq.room is not None and self.pd is not None:
            if self.pd.config.mode is PDMode.PREFILL:
                self._hand_to_decode(seq, cache)
                return
            if seq.prefill_id is not None and cache and self.pd.config.caching.writeback:
                self._write_back(seq)
                return
        cached_pages = seq.cached_tokens // self.page
        full = seq.num_computed // self.page if seq.prefilled else 0
        new_pages = full - cached_pages if cache and full > cached_pages else 0
        adopt, rest = seq.blocks[:new_pages], seq.blocks[new_pages:]
        if adopt:
            try:
                self._cache(seq, full, adopt)
            except Exception:  # caching failed: free everything, never leak
                log.exception("caching request %s failed", seq.rid)
                rest = seq.blocks
        self._done(seq, rest)

    def _done(self, seq: Sequence, rest: list[int], lock: InsertResult | None = None) -> None:
        """Free what the request still owns, unpin its prefix, wake the client."""
        if rest:
            self.pool.free_mem(rest)
        seq.blocks = []
        if seq.prefix is not None:
            self.pool.release(seq.prefix)
            seq.prefix = None
        if lock is not None:
            self.pool.release(lock)
        self.backend.release(seq)
        self.stats.generation_tokens += len(seq.output_ids)
        self.on_finish(time.perf_counter() - seq.arrival)
        if seq.finish_reason and seq.finish_reason.get("type") == "abort":
            self.stats.aborted += 1
        seq.events.put_nowait(DONE)

    def _hand_to_decode(self, seq: Sequence, cache: bool) -> None:
        """Prefill side: store every prompt page (partial last one too), pin it, push it."""
        n = len(seq.prompt_ids)
        cached_pages = seq.cached_tokens // self.page
        pages = -(-n // self.page)
        own = seq.blocks[: pages - cached_pages]
        spare = seq.blocks[pages - cached_pages :]
        lock: InsertResult | None = None
        try:
            addrs = (seq.prefix.addrs if seq.prefix is not None else []) + own
            whole = n // self.page
            engine, first_engine_page = own, cached_pages
            if cache and whole > cached_pages:  # whole pages become cache, pinned
                lock = self._cache(seq, whole, own[: whole - cached_pages], lock=True)
                engine, first_engine_page = own[whole - cached_pages :], whole
                # The index's blocks: pages another request cached meanwhile replaced ours.
                addrs = self.pool.match(seq.prompt_ids[: whole * self.page]).addrs + engine
            if engine:
                self.backend.store_pages(seq, first_engine_page, engine, partial=True)
        except Exception as exc:
            log.exception("request %s: preparing its KV for the decode instance failed", seq.rid)
            seq.handoff_error = f"preparing the KV failed: {exc}"
            seq.finish_reason = {"type": "abort", "message": seq.handoff_error}
            self.pd.fail_room(seq.room, seq.handoff_error)  # type: ignore[union-attr,arg-type]
            self._done(seq, seq.blocks)
            return
        seq.blocks = engine + spare
        tokens, first, reported = list(seq.prompt_ids), seq.output_ids[0], seq.cached_tokens

        async def push() -> None:
            try:
                await self.pd.send(seq.room, tokens, addrs, first, reported)  # type: ignore[union-attr,arg-type]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                seq.handoff_error = str(exc)
                seq.finish_reason = {"type": "abort", "message": str(exc)}
                self.pd.fail_room(seq.room, str(exc))  # type: ignore[union-attr,arg-type]
            finally:
                self._done(seq, seq.blocks, lock)

        self.pd.spawn(push())  # type: ignore[union-attr]

    def _write_back(self, seq: Sequence) -> None:
        """PD-Caching-3 decode side: cache locally, pinned, and send it to the prefill."""
        cached_pages = seq.cached_tokens // self.page
        full = seq.num_computed // self.page
        adopt, rest = seq.blocks[: full - cached_pages], seq.blocks[full - cached_pages :]
        try:
            lock = self._cache(seq, full, adopt, lock=True) if full > cached_pages else None
        except Exception:
            log.exception("caching request %s failed", seq.rid)
            self._done(seq, seq.blocks)
            return
        if lock is None:
            self._done(seq, rest)
            return
        tokens = seq.all_ids[: full * self.page]
        addrs = self.pool.match(tokens).addrs  # the index's blocks (duplicates were freed)
        prefill_id = seq.prefill_id
        self._done(seq, rest)  # the client has its answer; the write-back runs after

        async def send() -> None:
            try:
                await self.pd.write_back(prefill_id, tokens, addrs)  # type: ignore[union-attr,arg-type]
            finally:
                self.pool.release(lock)

        self.pd.spawn(send())  # type: ignore[union-attr]

    def _cache(
        self, seq: Sequence, full: int, adopt: list[int], lock: bool = False
    ) -> InsertResult | None:
        """Write the new pages' KV and insert the request's whole pages into the index;
        with `lock`, the inserted path stays pinned (the result releases it)."""
        cached_pages = seq.cached_tokens // self.page
        if adopt:
            self.backend.store_pages(seq, cached_pages, adopt)
        addrs = (seq.prefix.addrs if seq.prefix is not None else []) + adopt
        tokens = seq.all_ids[: full * self.page]
        flags = InsertFlags.LOCK if lock else InsertFlags.NONE
        result = self.pool.insert(tokens, addrs, flags)  # validates before it changes anything
        stored = result.new_tokens // self.page
        if stored:
            hashes = page_hashes(tokens, self.page)[full - stored :]
            self._hash_of_block.update(zip(addrs[full - stored :], hashes, strict=True))
            if self.events is not None:
                self.events.stored(tokens, full - stored, stored)
        return result if lock else None
