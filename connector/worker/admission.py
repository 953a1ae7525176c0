"""Admission: which requests prefill at a step, how much of each, and with what KV.

As SGLang's PrefillAdder: the request whose prompt is being prefilled in chunks (at most one)
goes first and takes its next chunk; then waiting requests join in arrival order while the
batch has room (`max_running_requests`) and the step has budget: `max_prefill_tokens` new
prompt tokens (the first request of a step may exceed it) and, with chunked prefill, the
chunk budget (`chunked_prefill_size`). A request longer than the chunk budget left takes what
is left, whole pages, and becomes the chunked request; its later chunks come first in the
next steps, and its first token after its last chunk.

Each request first gets its cached prefix (`prefix`: matched and pinned in MemPool, at least
one prompt token left to compute, since its logits give the first output token), whose pages
on the host tier are then loaded into device blocks (`KVCache.load`), then blocks for the
pages of its chunk. A request that does not fit waits for the next step (memory may be held
by running requests, or by transfers and pulls in flight); one longer than the whole KV
memory is refused.

Memory is also kept for the tokens running requests will still generate, as SGLang's
PrefillAdder keeps it: each running request is expected to generate `new_token_ratio` of
what it may still generate (at most CLIP_MAX_NEW_TOKENS), and a new request joins only if its
uncached prompt and all it may generate fit in what is left. The ratio (`TokenRatio`) starts
at `init`, decays each step to `min`, and jumps up when running requests had to be retracted,
so that a worker that over-admitted admits less.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from connector.worker.kv_cache import KVCache
from connector.worker.lora import LoRARegistry
from connector.worker.sequence import Sequence
from mempool import PrefixMatch

# Tokens a request is expected to generate at most, for memory planning (SGLang's
# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).
CLIP_MAX_NEW_TOKENS = 4096
# Decode steps each remaining request should have room for after a retraction (SGLang's
# SGLANG_RETRACT_DECODE_STEPS).
RETRACT_DECODE_STEPS = 20


@dataclass(slots=True)
class TokenRatio:
    """SGLang's new-token ratio: the share of its remaining `max_new_tokens` a running request
    is expected to still generate. Defaults as SGLang 0.5.23's (init 0.7, min 0.7 x 0.14,
    decayed from init to min over 600 steps)."""

    init: float = 0.7
    min: float = 0.098
    decay: float = (0.7 - 0.098) / 600
    current: float = 0.7

    def __post_init__(self) -> None:
        for name in ("init", "min", "decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name != "decay" and value > 1):
                raise ValueError(f"new-token ratio {name} must be in [0, 1], got {value}")
        if self.min > self.init:
            raise ValueError(f"min new-token ratio {self.min} is above the initial {self.init}")
        self.current = self.init

    def step(self) -> None:
        """A decode step without retraction: expect a little less."""
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        """The worker went idle."""
        self.current = self.init

    def after_retract(self, running: Iterable[Sequence]) -> None:
        """Requests had to be retracted: expect what the remaining ones generated so far, plus
        room for some more steps each, as a share of all they may generate (at most 1)."""
        seqs = list(running)
        decoded = sum(len(s.output_ids) for s in seqs)
        allowed = sum(s.sampling.max_new_tokens for s in seqs)
        self.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(seqs)) / (allowed + 1))

    def expected(self, seq: Sequence) -> int:
        """Tokens `seq` is expected to still generate (all of them with ignore_eos)."""
        left = min(max(seq.sampling.max_new_tokens - len(seq.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        return math.ceil(left if seq.sampling.ignore_eos else left * self.current)


@dataclass(slots=True)
class Admitted:
    """One step's outcome: requests that prefill now (a chunk or all of the rest), those of
    them admitted at this step, the one whose prompt continues next step, and requests that
    can never run."""

    prefills: list[Sequence] = field(default_factory=list)
    new: list[Sequence] = field(default_factory=list)
    chunked: Sequence | None = None
    refused: list[Sequence] = field(default_factory=list)


class Admission:
    """Takes requests from the waiting queue into the batch, their KV prepared."""

    def __init__(
        self,
        kv: KVCache,
        max_running_requests: int,
        max_prefill_tokens: int,
        enable_cache: bool,
        chunked_prefill_size: int | None = None,
        ratio: TokenRatio | None = None,
        lora: LoRARegistry | None = None,
    ) -> None:
        self.kv = kv
        self.lora = lora
        self.ratio = ratio if ratio is not None else TokenRatio()
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.enable_cache = enable_cache
        self.page = kv.page
        # Whole pages a step's prefills compute at most; None: no chunking.
        size = chunked_prefill_size
        self.chunk = size // self.page * self.page if size and size > 0 else None
        if self.chunk == 0:
            raise ValueError(
                f"chunked_prefill_size {size} is below the page size {self.page}: no chunk "
                "could ever hold a page"
            )

    def admit(
        self, waiting: deque[Sequence], running: list[Sequence], chunked: Sequence | None
    ) -> Admitted:
        """Take what fits, given the `running` requests in the batch and the `chunked` request
        whose prompt is part done."""
        out = Admitted()
        budget = self.max_prefill_tokens
        room = self.chunk
        # Tokens of KV memory left once running requests have what they will still generate.
        spare = self._spare_tokens(running, chunked)
        if chunked is not None:
            if not self._next_chunk(chunked):
                out.chunked = chunked  # no memory for its next chunk yet: it, and the
                return out  # queue behind it, wait
            out.prefills.append(chunked)
            budget -= chunked.extend_len
            room = None if room is None else room - chunked.extend_len
            if not chunked.ends_prompt:
                out.chunked = chunked
                return out
        busy = bool(running) or chunked is not None
        adapters = self._adapters(running, chunked)
        skipped: list[Sequence] = []
        while waiting and len(running) + len(out.prefills) < self.max_running_requests:
            seq = waiting[0]
            if not self._adapter_fits(seq, adapters):
                # its adapter has no slot in this batch, or cannot be loaded yet: SGLang
                # skips it for the requests behind it and tries it again next step
                skipped.append(waiting.popleft())
                continue
            prefix = self.prefix(seq)
            rest = self._rest(seq, prefix)
            if out.prefills and rest > budget:
                self._release(prefix)
                break
            need = rest + min(
                max(seq.sampling.max_new_tokens - len(seq.output_ids), 0), CLIP_MAX_NEW_TOKENS
            )
            if (busy or out.prefills) and need > spare:  # it would crowd the running ones out
                self._release(prefix)
                break
            if self._take(seq, prefix, room):
                spare -= rest + self.ratio.expected(seq)
                waiting.popleft()
                out.prefills.append(seq)
                out.new.append(seq)
                budget -= seq.extend_len
                room = None if room is None else room - seq.extend_len
                if not seq.ends_prompt:
                    out.chunked = seq
                    break
                continue
            self._release(prefix)
            if not out.prefills and not busy and self._never_fits(seq):
                out.refused.append(waiting.popleft())
                continue
            break  # memory held by running requests, transfers or pulls in flight: wait
        waiting.extendleft(reversed(skipped))  # at the front again, in their order
        return out

    def _adapters(self, running: list[Sequence], chunked: Sequence | None) -> set[str]:
        """Names of the adapters the batch already uses."""
        seqs = [*running, *([chunked] if chunked is not None else [])]
        return {s.lora.lora_name for s in seqs if s.lora is not None}

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """SGLang's LoRA admission: at most max_loras_per_batch adapters in a batch; an
        adapter not in memory is loaded (evicting an unused one) or the request waits.
        Held from here until the request finishes or is retracted."""
        if seq.lora is None or self.lora is None:
            return True
        name = seq.lora.lora_name
        if name not in adapters and len(adapters) >= self.lora.max_per_batch:
            return False
        if not seq.lora_held:
            loaded = self.lora.acquire(seq.lora, adapters)
            if loaded is None:
                return False
            seq.lora_held = True
            seq.lora_load_pending = seq.lora_load_pending or loaded
        adapters.add(seq.lora.lora_name)
        return True

    def _never_fits(self, seq: Sequence) -> bool:
        """`seq`'s tokens need more blocks than the request tier has at all."""
        tokens = len(seq.prompt_ids) + seq.fill_outputs
        return -(-tokens // self.page) * self.kv.bpp > self.kv.request_capacity_blocks

    def _spare_tokens(self, running: list[Sequence], chunked: Sequence | None) -> int:
        """KV tokens free or evictable on the request tier, less what running requests are
        expected to generate and the chunked request's prompt still needs."""
        kv = self.kv
        held = sum(len(s.blocks) for s in running)
        reserved = sum(self.ratio.expected(s) for s in running)
        if chunked is not None:
            held += len(chunked.blocks)
            reserved += len(chunked.fill_ids) - chunked.extend_from - chunked.extend_len
            reserved += self.ratio.expected(chunked)
        pinned = kv.pinned_pages * kv.bpp  # cached pages locked by requests and transfers
        free_blocks = kv.request_capacity_blocks - held - pinned
        return free_blocks // kv.bpp * self.page - reserved

    def prefix(self, seq: Sequence) -> PrefixMatch | None:
        """The cached prefix `seq` reuses, pinned, whole pages only; None without caching."""
        if not self.enable_cache:
            return None
        prompt = seq.fill_ids
        # Keep at least one prompt token to compute: its logits give the first token.
        return self.kv.match(prompt, (len(prompt) - 1) // self.page * self.page, seq.namespace)

    def _rest(self, seq: Sequence, prefix: PrefixMatch | None) -> int:
        """Prompt tokens `seq` still has to compute after its cached prefix."""
        fill = len(seq.prompt_ids) + seq.fill_outputs
        return fill - (len(prefix.addrs) * self.page if prefix else 0)

    def _take(self, seq: Sequence, prefix: PrefixMatch | None, room: int | None) -> bool:
        """Load `seq`'s prefix and give it blocks for its first chunk; False if none fits."""
        if room is not None and room < self.page and self._rest(seq, prefix) > room:
            return False  # not a page of chunk budget left, and it needs more
        host = 0
        if prefix is not None:
            loaded = self.kv.load(prefix, self._blocks_for(seq, prefix, room))
            if loaded is None:
                return False
            host = loaded  # (the prefix may be shorter now: a page it reached was busy)
        cached = len(prefix.addrs) * self.page if prefix else 0
        take = self._chunk_len(len(seq.prompt_ids) + seq.fill_outputs - cached, room)
        blocks = self.kv.alloc(self._blocks_for(seq, prefix, room))
        if blocks is None:
            return False
        seq.prefix, seq.cached_tokens, seq.blocks = prefix, cached, blocks
        seq.host_cached_tokens = host
        if seq.reported_cached is None:  # the response reports the first admission's hit
            seq.written_back_tokens = self.kv.written_back_tokens(prefix)
        seq.extend_from, seq.extend_len = cached, take
        return True

    def _blocks_for(self, seq: Sequence, prefix: PrefixMatch | None, room: int | None) -> int:
        """Blocks for the pages of `seq`'s first chunk after its prefix."""
        cached_pages = len(prefix.addrs) if prefix else 0
        end = cached_pages * self.page + self._chunk_len(self._rest(seq, prefix), room)
        return -(-end // self.page) - cached_pages

    def _chunk_len(self, rest: int, room: int | None) -> int:
        """Tokens of a `rest`-token remainder computed at this step: all of it, or as many
        whole pages as the chunk budget `room` holds."""
        if room is None or rest <= room:
            return rest
        return room // self.page * self.page

    def _next_chunk(self, seq: Sequence) -> bool:
        """The chunked request's next chunk, with blocks for its pages; False if no memory."""
        start = seq.extend_from + seq.extend_len
        take = self._chunk_len(len(seq.prompt_ids) + seq.fill_outputs - start, self.chunk)
        owned = seq.cached_tokens // self.page + len(seq.blocks)
        blocks = self.kv.alloc(-(-(start + take) // self.page) - owned)
        if blocks is None:
            return False
        seq.blocks.extend(blocks)
        seq.extend_from, seq.extend_len = start, take
        return True

    def _release(self, prefix: PrefixMatch | None) -> None:
        if prefix is not None:
            self.kv.release(prefix)
