"""The TTFT floor: each request's TTFT had it run alone with the oracle's cache.

Alone on an instance (no queue, no batch-mates) whose device cache holds everything the
oracle holds, a request computes only what the oracle could not reuse, in chunks of the
worker's `--chunked-prefill-size`, one engine step per chunk; its first token comes with the
last chunk. The seconds are the sim's own latency model (`connector/worker/latency_model.py`)
times the workers' time scale, so the floor is what no router and no cache can beat on these
workers; every p99 is also reported as a multiple of the floor's p99.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import percentile
from connector.worker.latency_model import LatencyModel


def floor_ttft_s(
    model: LatencyModel, prompt_tokens: int, cached_tokens: int, chunk: int, time_scale: float
) -> float:
    """Seconds to the first token of a prompt of `prompt_tokens` whose first
    `cached_tokens` are cached on the device, alone on the instance; `chunk` <= 0: one step."""
    done, left, seconds = cached_tokens, prompt_tokens - cached_tokens, 0.0
    while left > 0:
        size = min(chunk, left) if chunk > 0 else left
        seconds += model.step_s([(size, done)], 0, 0)
        done, left = done + size, left - size
    return seconds * time_scale


def model_from_info(info: dict[str, Any]) -> LatencyModel:
    """The latency model a sim worker reports in /get_server_info (its `backend` entry);
    fields this code does not know are left out, missing ones keep their defaults."""
    reported = (info.get("backend") or {}).get("latency_model") or {}
    known = {f.name for f in dataclasses.fields(LatencyModel)}
    return LatencyModel(**{k: v for k, v in reported.items() if k in known})


def chunk_from_info(info: dict[str, Any]) -> int:
    """The worker's chunk from /get_server_info: its chunked prefill size in whole pages,
    as the worker's admission cuts it (0: no chunking)."""
    value, page = info.get("chunked_prefill_size"), info.get("page_size") or 1
    if not isinstance(value, int | float) or value <= 0:
        return 0
    return int(value) // int(page) * int(page)


@dataclasses.dataclass(frozen=True)
class Floor:
    """How the floor is computed for one cluster's workers."""

    model: LatencyModel
    chunk: int
    time_scale: float
    lora_load_s: float = 0.0  # one LoRA adapter's load, wall seconds (adapter_floor)

    @classmethod
    def of_worker(cls, info: dict[str, Any]) -> Floor:
        backend = info.get("backend") or {}
        scale = float(backend.get("time_scale") or 0.0)
        model = model_from_info(info)
        size = backend.get("lora_bytes")
        load = model.lora_load_s(float(size)) * scale if isinstance(size, int | float) else 0.0
        return cls(model, chunk_from_info(info), scale, load)

    def ttft_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        return floor_ttft_s(self.model, prompt_tokens, cached_tokens, self.chunk, self.time_scale)

    def stats(
        self,
        hits: Sequence[int | None],
        lengths: Sequence[int | None],
        rids: Sequence[int],
        before_s: Sequence[float] | None = None,
    ) -> dict[str, float | None]:
        """`floor_ttft_mean_s`, `_p50_s`, `_p99_s` over the requests `rids` (the measured
        ones that were answered), from the oracle's hits and prompt lengths, plus per rid
        what it pays before its prefill wherever it runs (`before_s`: an adapter's first
        load, `adapter_floor`)."""
        floors = [
            self.ttft_s(n, hits[rid] or 0) + (before_s[rid] if before_s else 0.0)
            for rid in rids
            if (n := lengths[rid]) is not None
        ]
        if not floors:
            return {"floor_ttft_mean_s": None, "floor_ttft_p50_s": None, "floor_ttft_p99_s": None}
        return {
            "floor_ttft_mean_s": sum(floors) / len(floors),
            "floor_ttft_p50_s": percentile(floors, 0.5),
            "floor_ttft_p99_s": percentile(floors, 0.99),
        }
