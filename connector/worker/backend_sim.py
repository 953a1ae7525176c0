"""`sim` backend: the scheduler's real paths with the model step replaced by a latency model.

Output tokens are deterministic pseudo-text of the requested length: token i of an answer
depends only on the prompt's last page and i, so reruns and multi-turn replays agree. Each
stored page is stamped with its page hash (first 8 bytes) instead of being filled.

A colocated sim's blocks have the real size of the modelled model's pages (2 MiB per
16-token Llama-3.1-8B page, mapped without reserving memory). Wherever KV moves (one side of
a disaggregated pair, a host tier, pulls between instances: `stand_in=True`) it stores a
256-byte stand-in page instead (same page count), so the real paths (agents, TCP, insert,
write-back, swaps between tiers) run on small bytes, and the time the real bytes would take
is modelled: `wire_s` on the interconnect, slept by the sender between the allocation and the
data of each transfer; `host_copy_s` over PCIe for a load from the host tier, added to the
step that prefills the request. A LoRA adapter loaded for a request (`lora.py`) adds
`LatencyModel.lora_load_s` of `lora_bytes` to that step too; no adapter weights exist.
Stamps of KV that arrived or was cached are checked before it is used: a transfer or swap
that moved the wrong bytes fails the step.

A prefill computes the chunk `seq.extend_from`.. of `seq.extend_len` tokens (chunked
prefill); its first output token comes with the chunk that ends the prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from connector.worker.backend import Backend
from connector.worker.latency_model import LatencyModel
from connector.worker.sequence import Sequence
from shared.kv_events import page_hashes
from shared.tokenizer import ChatTokenizer


def _word_tokens(tokenizer: ChatTokenizer, limit: int = 512) -> list[int]:
    """Token ids that decode to a plain lower-case word with a leading space."""
    words = []
    for token_id in range(min(tokenizer.vocab_size, 20000)):
        piece = tokenizer.id_to_token(token_id) or ""
        if piece.startswith("Ġ") and piece[1:].isalpha() and piece[1:].islower() and len(piece) > 3:
            words.append(token_id)
            if len(words) == limit:
                break
    return words or list(range(1000, 1000 + limit))


class SimBackend(Backend):
    name = "sim"

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        page_size: int = 16,
        time_scale: float = 1.0,
        model: LatencyModel | None = None,
        context_length: int = 131072,
        stand_in: bool = False,
        lora_bytes: float = 84e6,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.latency = model or LatencyModel()
        self.modelled_spec = self.latency.kv_spec(page_size)
        self.stand_in = stand_in
        self.spec = self.latency.stand_in_spec(page_size) if stand_in else self.modelled_spec
        self.time_scale = time_scale
        self.context_length = context_length
        self.eos_token_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self._words = _word_tokens(tokenizer)
        self.simulated_busy_s = 0.0
        self.simulated_load_s = 0.0  # of which: waiting for host-tier KV
        self.lora_bytes = lora_bytes  # one adapter's weights (--sim-lora-size-mb)
        self.simulated_lora_load_s = 0.0  # of which: loading LoRA adapters
        self.verified_pages = 0

    @staticmethod
    def model_with_interconnect(gbps: float | None) -> LatencyModel:
        """The default latency model, its interconnect set to `gbps` Gb/s when given."""
        model = LatencyModel()
        if gbps is None:
            return model
        if gbps <= 0:
            raise ValueError(f"the interconnect needs a positive speed, got {gbps} Gb/s")
        return replace(
            model, interconnect=f"{gbps:g} Gb/s", interconnect_bytes_per_s=gbps * 1e9 / 8
        )

    def wire_s(self, pages: int) -> float:
        """Modelled seconds (unscaled) for one transfer of `pages` real-size pages."""
        return self.latency.transfer_s(pages, self.spec.page_size)

    def wire_model(self) -> Callable[[int], float]:
        return self.wire_s

    def recompute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Modelled seconds (unscaled) to prefill `new_tokens` after `cached_tokens`."""
        return self.latency.prefill_s(new_tokens, cached_tokens)

    def host_copy_s(self, pages: int) -> float:
        """Modelled seconds (unscaled) to copy `pages` real-size pages host <-> device."""
        return self.latency.host_copy_s(pages, self.spec.page_size)

    def lora_load_s(self) -> float:
        """/load_lora_adapter's modelled load, scaled (the request sleeps it)."""
        seconds = self.latency.lora_load_s(self.lora_bytes)
        self.simulated_lora_load_s += seconds
        return seconds * self.time_scale

    def host_copy_model(self) -> Callable[[int], float]:
        return self.host_copy_s

    def kv_bytes_per_token(self) -> int:
        """The modelled model's, whatever size the stored stand-in pages have."""
        return self.modelled_spec.bytes_per_token

    def default_kv_tokens(self) -> int:
        """What the modelled GPU holds."""
        return self.latency.kv_capacity_tokens(self.spec.page_size)

    def _next_token(self, seq: Sequence) -> int:
        tail = seq.prompt_ids[-self.spec.page_size :]
        seed = hashlib.blake2b(repr((tail, len(seq.output_ids))).encode(), digest_size=8).digest()
        return self._words[int.from_bytes(seed, "big") % len(self._words)]

    async def step(self, prefills: list[Sequence], decodes: list[Sequence]) -> None:
        if self.stand_in:
            for seq in (*prefills, *decodes):
                self._check_loaded(seq)
        chunks = [s.chunk for s in prefills]
        work = [(end - start, start) for start, end in chunks]
        # KV loaded from the host tier for a request is waited for before its first chunk.
        loads = [
            s.host_cached_tokens // self.spec.page_size
            for s, (start, _) in zip(prefills, chunks, strict=True)
            if s.host_cached_tokens and start == s.cached_tokens
        ]
        load_s = sum(self.host_copy_s(pages) for pages in loads)
        # An adapter loaded for a request (not in memory at its admission) before its step.
        lora_s = 0.0
        for seq in prefills:
            if seq.lora_load_pending:
                seq.lora_load_pending = False
                lora_s += self.latency.lora_load_s(self.lora_bytes)
        self.simulated_lora_load_s += lora_s
        context = sum(s.num_computed for s in decodes)
        seconds = self.latency.step_s(work, len(decodes), context, load_s + lora_s)
        self.simulated_busy_s += seconds
        self.simulated_load_s += load_s
        if seconds and self.time_scale:
            await asyncio.sleep(seconds * self.time_scale)
        for seq in (*[s for s in prefills if s.ends_prompt], *decodes):
            seq.output_ids.append(self._next_token(seq))

    def store_pages(
        self, seq: Sequence, first_page: int, addrs: list[int], partial: bool = False
    ) -> None:
        ps = self.spec.page_size
        if partial and (first_page + len(addrs)) * ps > seq.num_computed:
            addrs = addrs[:-1]  # a partial page carries no stamp: its hash is not defined yet
        last = first_page + len(addrs)
        if not addrs:
            return
        if last * ps > seq.num_computed:
            raise ValueError(f"page {last - 1} has no KV yet ({seq.num_computed} tokens computed)")
        hashes = page_hashes(seq.all_ids[: last * ps], ps)
        for addr, page_hash in zip(addrs, hashes[first_page:], strict=True):
            self.pool.view_block(addr)[:8] = page_hash.to_bytes(8, "big", signed=True)

    def _check_loaded(self, seq: Sequence) -> None:
        """KV this sequence uses without computing it (a cached prefix, or a prompt that
        arrived from a prefill instance) must carry its pages' stamps; checked once."""
        if seq.backend_state is not None:
            return
        seq.backend_state = "checked"
        ps = self.spec.page_size
        if seq.preloaded:
            pages, addrs = seq.preloaded // ps, seq.kv_addrs
        else:
            pages, addrs = seq.cached_tokens // ps, seq.prefix.addrs if seq.prefix else []
        if not pages:
            return
        hashes = page_hashes(seq.fill_ids[: pages * ps], ps)
        for page, (addr, page_hash) in enumerate(zip(addrs[:pages], hashes, strict=True)):
            want = page_hash.to_bytes(8, "big", signed=True)
            got = bytes(self.pool.view_block(addr)[:8])
            if got != want:
                raise ValueError(
                    f"request {seq.rid}: KV page {page} (block {addr:#x}) holds stamp "
                    f"{got.hex()}, not its page hash {want.hex()}: the KV moved or cached "
                    "for it is wrong"
                )
        self.verified_pages += pages

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "backend": self.name,
            "time_scale": self.time_scale,
            "latency_model": self.latency.describe(),
            "simulated_busy_s": round(self.simulated_busy_s, 6),
            "simulated_load_s": round(self.simulated_load_s, 6),
            "simulated_lora_load_s": round(self.simulated_lora_load_s, 6),
            "lora_bytes": self.lora_bytes,
            "kv_page_bytes": self.spec.page_bytes,
            "modelled_kv_page_bytes": self.modelled_spec.page_bytes,
        }
        if self.stand_in:
            info["kv_bytes"] = (
                "stand-in: each page stores and moves kv_page_bytes; transfer and host-tier "
                "copy times are modelled for modelled_kv_page_bytes a page on the latency "
                "model's interconnect and host link"
            )
            info["verified_pages"] = self.verified_pages
        return info
