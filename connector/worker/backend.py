"""The model step behind the scheduler: a real tiny model (`hf`) or a latency model (`sim`).

The scheduler owns MemPool and batching; a backend only computes. Per step it prefills the
new sequences (their prompt after the cached prefix) and decodes one token for each running
sequence, appending the next token id to `seq.output_ids`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from connector.worker.sequence import Sequence
from mempool import KVBlockSpec, MemPool


class Backend(ABC):
    """What the scheduler needs from a model."""

    name: str
    spec: KVBlockSpec  # shape of one KV page, as stored in MemPool blocks
    eos_token_ids: list[int]
    context_length: int

    def attach(self, pool: MemPool) -> None:
        """Called once with the worker's MemPool (backends read and write its blocks)."""
        self.pool = pool

    @abstractmethod
    async def step(self, prefills: list[Sequence], decodes: list[Sequence]) -> None:
        """Run one engine step; append one new token to each decode's output_ids, and to
        each prefill's whose chunk ends its prompt (`seq.ends_prompt`).

        A prefill computes prompt tokens [seq.extend_from, seq.extend_from + seq.extend_len).
        On its first chunk (extend_from == cached_tokens) the `seq.cached_tokens` tokens
        before it are in `seq.prefix.addrs` blocks (aggregated layout, one block per page):
        load them instead of recomputing; later chunks continue from the earlier ones' KV.
        """

    @abstractmethod
    def store_pages(
        self, seq: Sequence, first_page: int, addrs: list[int], partial: bool = False
    ) -> None:
        """Write the KV of pages first_page.. of seq.all_ids into `addrs` (one block a page).

        `partial`: the last page may be only partly computed (a prompt handed to a decode
        instance); its computed rows are written, the rest of the block is zero.
        A decode instance's sequence with `seq.preloaded` tokens has their KV in
        `seq.kv_addrs` before its first decode step: load it instead of computing.
        """

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes on the modelled device (what --hicache-size counts)."""
        return self.spec.bytes_per_token

    def default_kv_tokens(self) -> int | None:
        """KV cache capacity in tokens when the operator names none (None: the worker's)."""
        return None

    def wire_model(self) -> Callable[[int], float] | None:
        """Modelled seconds for one PD transfer of so many pages, when the KV bytes moved are
        a stand-in for bigger ones (None: the transfer's own time is the real one)."""
        return None

    def recompute_s(self, new_tokens: int, cached_tokens: int) -> float | None:
        """Estimated seconds to prefill `new_tokens` after `cached_tokens` of reused context
        (None: no estimate); what a pull or a load from the host tier is weighed against."""
        return None

    def host_copy_model(self) -> Callable[[int], float] | None:
        """Modelled seconds to copy so many pages between the host and device tiers, when
        the pages are stand-ins (None: the copy's own time is the real one)."""
        return None

    def lora_load_s(self) -> float:
        """Seconds (scaled, to sleep) that loading one LoRA adapter takes on the endpoint
        (0: nothing is modelled; the `hf` backend applies no adapter weights)."""
        return 0.0

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (finished or aborted)."""
        seq.backend_state = None

    def retract(self, seq: Sequence) -> None:
        """The sequence gave its KV up and will prefill again: forget its KV state, keep
        what must survive (`seq.resume_state`)."""
        seq.backend_state = None

    def info(self) -> dict[str, Any]:
        """What /get_server_info reports about the backend (model, latency parameters)."""
        return {"backend": self.name}
