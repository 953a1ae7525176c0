"""The router as an RSGI application: the head checked, the API key, then the route.

Inference routes go to `Router.serve_inference` with the body read under the limit; every
other route is a handler of `Management.routes()` (router.management). Every refusal is
SGLang's JSON error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from granian.rsgi import HTTPProtocol as RSGIHTTPProtocol
from granian.rsgi import Scope as RSGIHTTPScope

from router.admission import Refused
from router.forward.reply import Whole
from router.http_server import (
    HttpRequest,
    RequestRefused,
    Routes,
    RSGIClient,
    check_head,
    respond,
)
from router.request import INFERENCE_ROUTES, RequestError

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger(__name__)
UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer ...)"


class RouterApp:
    """Every route of one router process (`inference=False`: the routes given only, open,
    as on --prometheus-port)."""

    def __init__(
        self,
        router: Router,
        routes: Routes,
        extra_headers: list[tuple[str, str]] | None = None,
        inference: bool = True,
    ) -> None:
        self.router = router
        self.routes = routes
        self.extra = extra_headers or []
        self.inference = inference
        self.max_body = router.config.max_payload_bytes

    async def __rsgi__(self, scope: RSGIHTTPScope, proto: RSGIHTTPProtocol) -> None:
        extra = self.extra
        client: RSGIClient | None = None
        try:
            headers = check_head(scope)
            method, path = scope.method, scope.path
            if self.inference and not self.router.authorized(
                path, headers.get("authorization") or ""
            ):
                raise RequestRefused(Whole.error(401, UNAUTHORIZED))
            request = HttpRequest(method, path, scope.query_string, headers, proto, self.max_body)
            if self.inference and path in INFERENCE_ROUTES:
                if method != "POST":
                    message = f"{method} is not allowed on {path}"
                    raise RequestRefused(Whole.error(405, message, {"allow": "POST"}))
                raw = await request.read()
                client = RSGIClient(proto, extra)
                answer = await self.router.serve_inference(path, headers, raw, client)
                if not isinstance(answer, Whole):
                    return  # streamed: the relay wrote it
            else:
                handler, request.params = self.routes.find(
                    "GET" if method == "HEAD" else method, path
                )
                answer = await handler(request)
        except RequestRefused as exc:
            answer = exc.answer
        except RequestError as exc:
            answer = Whole.error(exc.status, str(exc), exc.headers)
        except Refused as exc:
            answer = Whole.error(429, str(exc), {"retry-after": str(exc.retry_after_s)})
        except Exception as exc:
            if client is not None and client.stream is not None:  # the answer has begun
                if not isinstance(exc, ConnectionResetError):  # (else: the client left)
                    log.exception("%s %s failed mid-answer", scope.method, scope.path)
                return
            log.exception("%s %s failed", scope.method, scope.path)
            answer = Whole.error(500, "internal error in the router (see its log)")
        finally:
            if client is not None:
                client.close()
        respond(proto, answer, extra)
