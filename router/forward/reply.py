"""Where an inference answer goes, whichever HTTP server took the request.

The dispatcher and the relay do not know which HTTP server took the request. A whole answer
comes back as a `Whole` (status, headers, body) for the server to write; a streamed one is
written as it arrives through the `Stream` its `ClientSide` opened.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import msgspec

from shared.http_errors import error_body


@dataclass(slots=True)
class Whole:
    """An answer written at once: its status, headers (lowercase names) and body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def error(cls, status: int, message: str, headers: dict[str, str] | None = None) -> Whole:
        """SGLang's OpenAI-style JSON error with this status."""
        body = msgspec.json.encode(error_body(status, message))
        kind = {"content-type": "application/json; charset=utf-8"}  # as aiohttp's json_response
        return cls(status, body, {**kind, **(headers or {})})


class Stream(ABC):
    """A client's streamed answer, its status and headers already sent."""

    @abstractmethod
    async def write(self, chunk: bytes) -> None:
        """Send `chunk` (waits while the client reads slower than the worker writes);
        ConnectionResetError when the client has gone."""

    @abstractmethod
    async def write_eof(self) -> None:
        """End the answer."""


class ClientSide(ABC):
    """The client of one request, as the relay sees it."""

    @abstractmethod
    async def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Send the status and headers of a streamed answer."""
