"""One JSON error body for the worker and the router (SGLang's OpenAI-style error shape)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

_KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "WorkerError",
    503: "ServiceUnavailable",
}


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """`{"object": "error", "message", "type", "param": null, "code"}`."""
    return {
        "object": "error",
        "message": message,
        "type": kind or _KINDS.get(status, "Error"),
        "param": None,
        "code": status,
    }


def json_error(
    status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """The error body as an aiohttp response with this status."""
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)
