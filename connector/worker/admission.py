"""Admission: which waiting requests join the running batch at a step, and with what KV.

Requests are taken in arrival order while the batch has room (`max_running_requests`). Each
one first gets its cached prefix (`prefix`: matched and pinned in MemPool, at least one
prompt token left to compute, since its logits give the first output token), then blocks for
the rest of its prompt, within the step's budget of new prompt tokens (`max_prefill_tokens`;
the first request of a step may exceed it). A request that does not fit waits for the next
step; one that cannot fit even with nothing else running is refused.

The two parts are separate steps so that they can grow on their own: a host-tier swap-in or
the pull of a remote prefix lengthens `prefix`; chunked prefill caps `new_tokens` and keeps
the rest of the prompt for later steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from connector.worker.kv_cache import KVCache
from connector.worker.sequence import Sequence
from mempool import PrefixMatch


@dataclass(slots=True)
class Admitted:
    """One step's outcome: requests that prefill now, and requests that can never run."""

    prefills: list[Sequence] = field(default_factory=list)
    refused: list[Sequence] = field(default_factory=list)


class Admission:
    """Takes requests from the waiting queue into the batch, their KV prepared."""

    def __init__(
        self, kv: KVCache, max_running_requests: int, max_prefill_tokens: int, enable_cache: bool
    ) -> None:
        self.kv = kv
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.enable_cache = enable_cache
        self.page = kv.page

    def admit(self, waiting: deque[Sequence], running: int) -> Admitted:
        """Take what fits from the head of `waiting`, given `running` requests in the batch."""
        out = Admitted()
        budget = self.max_prefill_tokens
        while waiting and running + len(out.prefills) < self.max_running_requests:
            seq = waiting[0]
            prefix = self.prefix(seq)
            usable = len(prefix.addrs) if prefix is not None else 0
            new_tokens = self.new_tokens(seq, usable)
            blocks = None
            if not out.prefills or new_tokens <= budget:
                blocks = self.kv.alloc(-(-len(seq.prompt_ids) // self.page) - usable)
            if blocks is None:
                if prefix is not None:
                    self.kv.release(prefix)
                if not out.prefills and not running:  # nothing holds memory: it never fits
                    out.refused.append(waiting.popleft())
                    continue
                break
            waiting.popleft()
            seq.prefix, seq.cached_tokens, seq.blocks = prefix, usable * self.page, blocks
            budget -= new_tokens
            out.prefills.append(seq)
        return out

    def prefix(self, seq: Sequence) -> PrefixMatch | None:
        """The cached prefix `seq` reuses, pinned, whole pages only; None without caching."""
        if not self.enable_cache:
            return None
        prompt = seq.prompt_ids
        match = self.kv.match(prompt)
        # Keep at least one prompt token to compute: its logits give the first token.
        usable = min(match.num_tokens, len(prompt) - 1) // self.page
        match.addrs = match.addrs[:usable]
        return match

    def new_tokens(self, seq: Sequence, cached_pages: int) -> int:
        """Prompt tokens `seq` computes at this step."""
        return len(seq.prompt_ids) - cached_pages * self.page
