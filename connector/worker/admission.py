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
pages of its chunk. A request that does not fit waits for the next step; one that cannot fit
even with nothing else running is refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from connector.worker.kv_cache import KVCache
from connector.worker.sequence import Sequence
from mempool import PrefixMatch


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
    ) -> None:
        self.kv = kv
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

    def admit(self, waiting: deque[Sequence], running: int, chunked: Sequence | None) -> Admitted:
        """Take what fits, given `running` requests in the batch and the `chunked` request
        whose prompt is part done."""
        out = Admitted()
        budget = self.max_prefill_tokens
        room = self.chunk
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
        while waiting and running + len(out.prefills) < self.max_running_requests:
            seq = waiting[0]
            prefix = self.prefix(seq)
            if out.prefills and self._rest(seq, prefix) > budget:
                self._release(prefix)
                break
            if self._take(seq, prefix, room):
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
            if not out.prefills and not running and chunked is None:  # it never fits
                out.refused.append(waiting.popleft())
                continue
            break
        return out

    def prefix(self, seq: Sequence) -> PrefixMatch | None:
        """The cached prefix `seq` reuses, pinned, whole pages only; None without caching."""
        if not self.enable_cache:
            return None
        prompt = seq.prompt_ids
        # Keep at least one prompt token to compute: its logits give the first token.
        return self.kv.match(prompt, (len(prompt) - 1) // self.page * self.page)

    def _rest(self, seq: Sequence, prefix: PrefixMatch | None) -> int:
        """Prompt tokens `seq` still has to compute after its cached prefix."""
        return len(seq.prompt_ids) - (len(prefix.addrs) * self.page if prefix else 0)

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
        take = self._chunk_len(len(seq.prompt_ids) - cached, room)
        blocks = self.kv.alloc(self._blocks_for(seq, prefix, room))
        if blocks is None:
            return False
        seq.prefix, seq.cached_tokens, seq.blocks = prefix, cached, blocks
        seq.host_cached_tokens = host
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
        take = self._chunk_len(len(seq.prompt_ids) - start, self.chunk)
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
