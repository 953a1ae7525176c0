"""How a client answers a 429: wait the server's Retry-After, then send again, a few times."""

from __future__ import annotations

import email.utils
import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Retry429:
    """As the OpenAI SDK does: wait the server's Retry-After (`default_wait_s` when it gives
    none it can read), then send again, at most `max_retries` times; a Retry-After beyond
    `max_wait_s` is not waited for (an error)."""

    max_retries: int = 3
    default_wait_s: float = 1.0
    max_wait_s: float = 60.0

    def wait_s(self, status: int, retry_after: str | None, retries: int) -> float | None:
        """Seconds to wait before the next try, or None: do not try again."""
        if status != 429 or retries >= self.max_retries:
            return None
        wait = parse_retry_after(retry_after)
        wait = self.default_wait_s if wait is None else wait
        return wait if wait <= self.max_wait_s else None


RETRY_429 = Retry429()
NO_RETRY = Retry429(max_retries=0)  # a 429 is a refused request


def parse_retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (delay-seconds, or an HTTP date from now); None when
    absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None
