"""What the fuzz tests of the router and the worker check beyond schemathesis' own."""

from __future__ import annotations

import json
from typing import Any

from schemathesis.checks import CheckContext
from schemathesis.core.failures import Failure


def error_bodies_are_json(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    """Every 4xx says what is wrong in the JSON error shape."""
    if 400 <= response.status_code < 500:
        body = json.loads(response.content)
        if not (isinstance(body, dict) and isinstance(body.get("message"), str)):
            raise Failure(
                operation=case.operation.label,
                title="4xx without a JSON error",
                message=f"{response.status_code}: {response.content[:200]!r}",
            )
    return None
