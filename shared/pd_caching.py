"""MemServe's caching modes of a disaggregated pair (table 4), shared by worker and router.

Both sides must agree: the worker decides what it caches and sends, the router which prompt
trees it updates.
"""

from __future__ import annotations

from enum import Enum


class Caching(Enum):
    """MemServe table 4: where a disaggregated pair keeps KV for the next turn."""

    BASIC = "basic"  # nothing cached; all KV sent every time
    CACHING_1 = "caching-1"  # the prefill instance caches prompts
    CACHING_2 = "caching-2"  # + decode caches its KV; prefill sends only what decode lacks
    CACHING_3 = "caching-3"  # + decode writes its KV back to prefill after each request

    @classmethod
    def parse(cls, value: str) -> Caching:
        text = value.lower().replace("_", "-").removeprefix("pd-")
        for mode in cls:
            if text == mode.value:
                return mode
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown PD caching mode {value!r}; expected one of {names}")

    @property
    def prefill_caches(self) -> bool:
        return self is not Caching.BASIC

    @property
    def decode_caches(self) -> bool:
        return self in (Caching.CACHING_2, Caching.CACHING_3)

    @property
    def writeback(self) -> bool:
        return self is Caching.CACHING_3
