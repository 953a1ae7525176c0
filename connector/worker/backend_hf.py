"""The real tiny-model backend: SmolLM2-135M-Instruct in float32 on CPU, KV pages in MemPool.

A prefill whose prefix MemPool already holds copies those pages' K/V into a fresh transformers
`DynamicCache` and runs the model only on the rest of the prompt; a chunked prefill runs one
chunk a step on the same cache and samples the first token after the last one; `store_pages`
copies a sequence's K/V back out into MemPool blocks. Both use MemPool's aggregated layout:
one block a page, layer-major, K before V, each segment [kv_heads, page_size, head_dim]
contiguous.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from connector.worker.backend import Backend
from connector.worker.sequence import SamplingParams, Sequence
from mempool import InvalidRequest, KVBlockSpec, Layout, MemPool

if TYPE_CHECKING:
    from transformers import DynamicCache

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers is imported later, in the methods

MAX_DEFAULT_THREADS = 4  # a 135M model gains little past 4 threads; leave cores to neighbours


@dataclass(slots=True)
class HFState:
    """What HFBackend keeps in `seq.backend_state`: the sequence's KV and its sampling RNG."""

    cache: DynamicCache
    generator: torch.Generator | None  # None for greedy sequences


def _layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers cache layer's keys and values; ValueError if it holds none."""
    from transformers.cache_utils import CacheLayerMixin

    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise ValueError(f"cache layer {layer!r} holds no attention keys and values")
    return layer.keys, layer.values


def default_threads() -> int:
    """Torch threads for one worker: its CPU share, at most MAX_DEFAULT_THREADS."""
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))


class HFBackend(Backend):
    """SmolLM2-135M-Instruct via transformers, float32 on CPU.

    The scheduler batches at step granularity; within a step the forward passes run one
    sequence at a time (per-sequence DynamicCaches: no padding, no masks, simple). That is
    correct but not free: a decode is memory-bound (each token reads all ~540 MB of weights),
    so one batched forward would serve several sequences for little more than one costs.
    All torch work runs on one dedicated thread so the event loop stays responsive; the
    sequences themselves are only mutated back on the event loop's thread.
    """

    name = "hf"
    # Prefill seconds per token before any is measured (one core of this CPU measures ~3 ms).
    prefill_s_per_token = 2e-3

    def __init__(
        self, model_path: Path | None = None, page_size: int = 16, threads: int | None = None
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if model_path is None:
            from connector.model_files import ensure_hf_model

            model_path = ensure_hf_model()
        self.model_path = Path(model_path)
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.model.eval()
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.spec = KVBlockSpec(
            layers=config.num_hidden_layers,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            dtype="float32",
            page_size=page_size,
        )
        self.context_length = int(config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(
            self.model_path, GenerationConfig.from_pretrained(self.model_path).eos_token_id
        )
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        # One thread: torch calls stay serialised, and the set_num_threads applies to it too.
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="hf-backend",
            initializer=torch.set_num_threads,
            initargs=(self.threads,),
        )

    def attach(self, pool: MemPool) -> None:
        """Refuse a pool whose blocks do not have this model's page shape."""
        if pool.layout is not Layout.AGGREGATED:
            raise ValueError(f"HFBackend needs an aggregated MemPool, got {pool.layout.value}")
        if pool.spec != self.spec:
            raise ValueError(f"MemPool spec {pool.spec} does not match the model's {self.spec}")
        super().attach(pool)

    # ----------------------------------------------------------------- steps

    async def step(self, prefills: list[Sequence], decodes: list[Sequence]) -> None:
        if not prefills and not decodes:
            return
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self._step_sync, prefills, decodes)
        for seq, token, state in results:
            if state is not None:
                seq.backend_state = state
            if token is not None:
                seq.output_ids.append(token)

    def _step_sync(
        self, prefills: list[Sequence], decodes: list[Sequence]
    ) -> list[tuple[Sequence, int | None, HFState | None]]:
        results: list[tuple[Sequence, int | None, HFState | None]] = []
        with torch.inference_mode():
            for seq in prefills:
                state, logits = self._timed_prefill(seq)
                token = _sample(logits, seq.sampling, state.generator) if seq.ends_prompt else None
                results.append((seq, token, state))
            for seq in decodes:
                state, logits = self._decode(seq)
                results.append((seq, _sample(logits, seq.sampling, state.generator), None))
        return results

    def _timed_prefill(self, seq: Sequence) -> tuple[HFState, torch.Tensor]:
        """`_prefill`, keeping its seconds per token (an exponential average over chunks long
        enough to measure) for `recompute_s`."""
        start, end = seq.chunk
        began = time.perf_counter()
        out = self._prefill(seq)
        if end - start >= 32:
            rate = (time.perf_counter() - began) / (end - start)
            self.prefill_s_per_token = 0.8 * self.prefill_s_per_token + 0.2 * rate
        return out

    def recompute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Measured on this machine: recent prefills' seconds per token, times the tokens."""
        return new_tokens * self.prefill_s_per_token

    def _prefill(self, seq: Sequence) -> tuple[HFState, torch.Tensor]:
        from transformers import DynamicCache

        prompt = seq.fill_ids
        if not prompt:
            raise ValueError(f"request {seq.rid}: empty prompt")
        if len(prompt) >= self.context_length:
            raise ValueError(f"request {seq.rid}: prompt of {len(prompt)} tokens too long")
        start, end = seq.chunk
        # The last prompt token is always recomputed: its logits give the first output token.
        if not 0 <= start < end <= len(prompt) or start < min(seq.cached_tokens, len(prompt) - 1):
            raise ValueError(f"request {seq.rid}: bad prefill chunk {start}..{end}")
        state = seq.backend_state
        if isinstance(state, HFState) and start and state.cache.get_seq_length() == start:
            pass  # a later chunk: continue the earlier chunks' cache
        elif start > seq.cached_tokens:
            raise RuntimeError(f"request {seq.rid}: chunk at {start} without the KV before")
        else:
            cache = DynamicCache(config=self.model.config)
            if start > 0:
                self._load_kv(seq.rid, seq.prefix.addrs if seq.prefix else [], cache, start)
            kept = seq.resume_state  # a retracted sequence samples on from where it was
            generator = kept if isinstance(kept, torch.Generator) else None
            state = HFState(cache, generator or self._generator(seq.sampling))
        return state, self._forward(prompt[start:end], start, state.cache)

    def retract(self, seq: Sequence) -> None:
        """Drop the sequence's KV but keep its sampling RNG, so that a seeded request
        retracted and resumed samples the same tokens as one never retracted."""
        state = seq.backend_state
        if isinstance(state, HFState):
            seq.resume_state = state.generator
        seq.backend_state = None

    @staticmethod
    def _generator(sampling: SamplingParams) -> torch.Generator | None:
        """The sequence's sampling RNG (None when greedy)."""
        if sampling.greedy:
            return None
        generator = torch.Generator()
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        return generator

    def _decode(self, seq: Sequence) -> tuple[HFState, torch.Tensor]:
        state = seq.backend_state
        if state is None and seq.preloaded and seq.output_ids:  # KV from a prefill instance
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            self._load_kv(seq.rid, seq.kv_addrs, cache, seq.preloaded)
            state = seq.backend_state = HFState(cache, self._generator(seq.sampling))
        if not isinstance(state, HFState) or not seq.output_ids:
            raise ValueError(f"request {seq.rid}: decode before prefill")
        position = seq.num_computed  # position of the last output token, not yet fed
        if state.cache.get_seq_length() != position:
            raise RuntimeError(
                f"request {seq.rid}: cache holds {state.cache.get_seq_length()} tokens, "
                f"expected {position}"
            )
        return state, self._forward(seq.output_ids[-1:], position, state.cache)

    def _forward(self, tokens: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        """Feed `tokens` at positions start.. into `cache`; the last position's logits."""
        ids = torch.tensor([tokens], dtype=torch.long)
        positions = torch.arange(start, start + len(tokens), dtype=torch.long).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()

    # ----------------------------------------------------------------- MemPool pages

    def _load_kv(self, rid: str, addrs: list[int], cache: DynamicCache, num_tokens: int) -> None:
        """Fill an empty cache with the first `num_tokens` K/V from these page blocks."""
        page = self.spec.page_size
        pages = -(-num_tokens // page)
        if len(addrs) < pages:
            raise ValueError(
                f"request {rid}: KV of {num_tokens} tokens wanted but only {len(addrs)} "
                f"blocks of {page} tokens are there"
            )
        layers, heads, dim = self.spec.layers, self.spec.kv_heads, self.spec.head_dim
        buf = torch.empty(pages, 2 * layers, heads, page, dim, dtype=torch.float32)
        for i, addr in enumerate(addrs[:pages]):
            self._read_page(addr, buf[i])
        # [pages, 2L, H, P, D] -> [2L, H, pages*P, D], then the first num_tokens positions.
        kv = buf.permute(1, 2, 0, 3, 4).reshape(2 * layers, heads, pages * page, dim)
        kv = kv[:, :, :num_tokens]
        for layer in range(layers):
            k = kv[self.spec.segment_index(layer, False)].unsqueeze(0)
            v = kv[self.spec.segment_index(layer, True)].unsqueeze(0)
            cache.update(k.contiguous(), v.contiguous(), layer)

    def store_pages(
        self, seq: Sequence, first_page: int, addrs: list[int], partial: bool = False
    ) -> None:
        """Copy the K/V of pages first_page.. into MemPool blocks (one block a page).

        Only pages whose every position is computed (< seq.num_computed) can be stored: the
        last output token has no KV until the next decode feeds it. With `partial`, the last
        page may be partly computed: its other rows are zero.
        """
        state = seq.backend_state
        page = self.spec.page_size
        if state is None and _already_there(seq, first_page, addrs, page):
            return  # KV that arrived from a prefill instance, not yet decoded on: in place
        if not isinstance(state, HFState):
            raise ValueError(f"request {seq.rid}: no KV (not prefilled, or released)")
        if first_page < 0 or not addrs:
            raise ValueError(f"store_pages needs first_page >= 0 and blocks, got {first_page}")
        end = (first_page + len(addrs)) * page
        have = min(seq.num_computed, state.cache.get_seq_length())
        if end > have and not (partial and end - have < page):
            raise ValueError(
                f"request {seq.rid}: pages {first_page}..{first_page + len(addrs) - 1} need KV "
                f"of positions < {end}, only {have} computed"
            )
        start = first_page * page
        stop = min(end, have)
        layers, heads, dim = self.spec.layers, self.spec.kv_heads, self.spec.head_dim
        with torch.inference_mode():
            per_layer = [
                torch.nn.functional.pad(
                    torch.stack((keys[0, :, start:stop], values[0, :, start:stop])),
                    (0, 0, 0, end - stop),
                )
                for keys, values in map(_layer_kv, state.cache.layers[:layers])
            ]
            # [L, 2, H, n*P, D] -> [n, 2L, H, P, D]: each page's block, layer-major, K first.
            pages = (
                torch.stack(per_layer)
                .reshape(2 * layers, heads, len(addrs), page, dim)
                .permute(2, 0, 1, 3, 4)
            )
            for i, addr in enumerate(addrs):
                self._write_page(addr, pages[i])

    def _read_page(self, addr: int, out: torch.Tensor) -> None:
        try:
            view = self.pool.view_block(addr)
        except InvalidRequest:  # a GPU-tier block has no host view
            out.copy_(_as_page(bytearray(self.pool.read_block(addr)), out.shape))
            return
        with view:
            src = _as_page(view, out.shape)
            out.copy_(src)
            del src  # drop the buffer export before the view is released

    def _write_page(self, addr: int, page: torch.Tensor) -> None:
        try:
            view = self.pool.view_block(addr)
        except InvalidRequest:
            self.pool.write_block(addr, page.contiguous().numpy().tobytes())
            return
        with view:
            dst = _as_page(view, page.shape)
            dst.copy_(page)
            del dst

    # ----------------------------------------------------------------- reporting

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "model": "SmolLM2-135M-Instruct",
            "model_path": str(self.model_path),
            "dtype": "float32",
            "parameters": self.num_parameters,
            "threads": self.threads,
            "page_size": self.spec.page_size,
            "context_length": self.context_length,
        }


def _already_there(seq: Sequence, first_page: int, addrs: list[int], page: int) -> bool:
    """The pages are blocks a prefill instance wrote this sequence's KV into (preloaded)."""
    end = first_page + len(addrs)
    return first_page >= 0 and end * page <= seq.preloaded and seq.kv_addrs[first_page:end] == addrs


def _as_page(buffer: Any, shape: torch.Size) -> torch.Tensor:
    """A float32 tensor over a block's bytes (zero-copy)."""
    return torch.frombuffer(buffer, dtype=torch.float32).view(shape)


def _eos_ids(model_path: Path, generation_eos: int | list[int] | None) -> list[int]:
    """EOS ids from the generation config plus the tokenizer's eos_token (deduplicated)."""
    ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    try:
        eos = json.loads((model_path / "tokenizer_config.json").read_text()).get("eos_token")
        added = json.loads((model_path / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return ids
    ids += [t["id"] for t in added if isinstance(eos, str) and t.get("content") == eos]
    return list(dict.fromkeys(ids))


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy, or temperature / top-k / top-p sampling from one position's logits."""
    if params.greedy or generator is None:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
