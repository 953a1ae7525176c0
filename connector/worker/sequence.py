"""One request's state inside the worker, shared by the scheduler and the model backends."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mempool import PrefixMatch

if TYPE_CHECKING:
    from connector.worker.lora import LoRARef
    from shared.namespaces import CacheNamespace

# What `Sequence.events` carries to the request's HTTP handler: a step appended a token, or the
# request ended (finish_reason says how).
TOKEN, DONE = "token", "done"


@dataclass(slots=True)
class SamplingParams:
    """SGLang's sampling parameters that this worker honours (names as SGLang spells them)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(eq=False, slots=True)
class Sequence:
    """A request from admission to finish.

    Token positions: `prompt_ids` then `output_ids`. The first `cached_tokens` prompt tokens
    were served from MemPool (`prefix` holds their locked blocks); `blocks` are the blocks
    this request owns for the pages after them, grown as it decodes.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefix: PrefixMatch | None = None
    blocks: list[int] = field(default_factory=list)
    backend_state: Any = None  # owned by the backend (e.g. a transformers DynamicCache)
    finish_reason: dict[str, Any] | None = None
    events: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    prefilled: bool = False
    # Disaggregation: the SGLang bootstrap room this request belongs to; on a decode
    # instance, the prompt tokens whose KV arrived from the prefill instance (loaded, not
    # computed), the prefill's own cached_tokens (what the response reports) and its id.
    room: int | None = None
    preloaded: int = 0
    reported_cached: int | None = None
    prefill_id: int | None = None
    handoff_error: str | None = None  # the KV could not move between the two instances
    # Chunked prefill: this step computes prompt tokens [extend_from, extend_from +
    # extend_len) (`chunk`); the ones before have KV (cached prefix, earlier chunks). The
    # first output token comes after the chunk that ends the prompt.
    extend_from: int = 0
    extend_len: int = 0
    # Hierarchical cache: tokens of the cached prefix that were loaded from the host tier.
    host_cached_tokens: int = 0
    # Decode-to-prefill write-back (PD-Caching-3): tokens of the cached prefix whose pages a
    # decode instance wrote back to this prefill; on a decode, the prefill's count.
    written_back_tokens: int = 0
    write_back: bool = True  # PD-Caching-3 decode: write the KV back to the prefill (router's say)
    # A pull from a peer before admission: prompt tokens [pulled_from, pulled_to) whose KV it
    # brought into this instance's cache for this request.
    pulled_from: int = 0
    pulled_to: int = 0
    reported_pulled: int | None = None  # a decode: what its prefill pulled for the request
    # Retraction (SGLang's): a running request whose KV was given up for memory waits again
    # and prefills its prompt plus the first `fill_outputs` output tokens, reusing what the
    # cache kept; `resume_state` is what the backend keeps across it (a sampling RNG).
    retractions: int = 0
    fill_outputs: int = 0
    resume_state: Any = None
    # Cache namespace (extra_key, adapter, cache_salt): the index keys its pages by it.
    namespace: CacheNamespace | None = None
    # LoRA: the adapter it runs with; `lora_held` while admitted (counted in use), and
    # `lora_load_pending` when its admission loaded the adapter (the sim charges the time).
    lora: LoRARef | None = None
    lora_held: bool = False
    lora_load_pending: bool = False

    @property
    def pulled_tokens(self) -> int:
        """Prompt tokens of the reused prefix whose KV was pulled from a peer for this request."""
        if self.reported_pulled is not None:
            return self.reported_pulled
        return max(0, min(self.cached_tokens, self.pulled_to) - self.pulled_from)

    @property
    def report_cached(self) -> int:
        """cached_tokens as the response reports it: prompt tokens whose prefill was skipped
        thanks to this instance's own cache (pulled tokens are reported apart)."""
        if self.reported_cached is not None:
            return self.reported_cached
        return self.cached_tokens - self.pulled_tokens

    @property
    def cached_tokens_details(self) -> dict[str, int]:
        """cached_tokens by where the KV was found (SGLang's meta_info name)."""
        host = self.host_cached_tokens
        return {"device": self.report_cached - host, "host": host}

    @property
    def fill_ids(self) -> list[int]:
        """The tokens a prefill computes through: the prompt, and after a retraction the
        output generated before it (its next token comes from the last one's logits)."""
        if not self.fill_outputs:
            return self.prompt_ids
        return self.prompt_ids + self.output_ids[: self.fill_outputs]

    @property
    def resumed(self) -> bool:
        """Retracted at least once: its first token was sent long ago."""
        return self.retractions > 0

    @property
    def chunk(self) -> tuple[int, int]:
        """Fill tokens [start, end) this step's prefill computes: the chunk admission set,
        or (none set) everything after the cached prefix."""
        n = len(self.prompt_ids) + self.fill_outputs
        if self.extend_len:
            return self.extend_from, self.extend_from + self.extend_len
        return min(self.cached_tokens, n - 1), n  # the last token's logits give the first

    @property
    def ends_prompt(self) -> bool:
        """This step's prefill reaches the end of the fill tokens (a token comes out)."""
        return self.chunk[1] >= len(self.prompt_ids) + self.fill_outputs

    @property
    def kv_addrs(self) -> list[int]:
        """Blocks of every page with KV, in order: the cached prefix, then owned blocks."""
        return (self.prefix.addrs if self.prefix is not None else []) + self.blocks

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_computed(self) -> int:
        """Tokens whose KV exists: the prompt and every output token but the last (unfed)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)
