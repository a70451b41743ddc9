"""ASGI guards around the API and the MCP server's HTTP app: a request id on every answer, and one
answer for anything unexpected (a 500 logged as one line, no page text; a 503 while the database
cannot serve). The body cap is worker.bodycap's."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.routing import compile_path

from worker.bodycap import ASGIApp, Receive, Scope, Send, send_json
from worker.db import database_unavailable
from worker.runtime.logs import log_context

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_SCOPE_KEY = "factmill.request_id"


def request_id_of(scope: Scope) -> str:
    """The request id the guard gave this request ("-" outside it)."""
    return str(scope.get(REQUEST_ID_SCOPE_KEY, "-"))


def _incoming_request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            candidate = value.decode("latin-1")
            if _SANE_REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The matched route's template (never the raw path, which may hold page slugs), else "unmatched".
    A request answered before the router ran (a body over the cap by its Content-Length: 413, 400) is
    matched against the app's documented paths: counted as "unmatched", the webhook's 413s could not be
    told from a scanner's 404s."""
    template = getattr(scope.get("route"), "path", None)
    if template:
        return str(template)
    path = scope.get("path", "")
    for pattern, documented in _documented_paths(scope.get("app")):
        if pattern.fullmatch(path):
            return documented
    return "unmatched"


def _documented_paths(app: Any) -> list[tuple[re.Pattern[str], str]]:
    """The paths of the app's OpenAPI document as patterns (once per app); none for an app without one."""
    state = getattr(app, "state", None)
    if state is None or not callable(getattr(app, "openapi", None)):
        return []
    known: list[tuple[re.Pattern[str], str]] | None = getattr(state, "factmill_documented_paths", None)
    if known is None:
        known = [(compile_path(p)[0], p) for p in app.openapi().get("paths", {})]
        state.factmill_documented_paths = known
    return known


def log_unexpected(method: str, route: str, request_id: str, exc: BaseException) -> None:
    """ONE line per unexpected error: no message (it may quote page text), no traceback but at DEBUG."""
    logger.error("unhandled %s on %s %s (request %s)", type(exc).__name__, method[:16], route, request_id)
    logger.debug("traceback of request %s", request_id, exc_info=exc)


# How long a client should wait before trying again while the database cannot serve.
UNAVAILABLE_RETRY_AFTER_SECONDS = 5
# The client went away before its body was read (nginx's code): no answer reaches it, nothing failed.
CLIENT_CLOSED_REQUEST = 499


def unexpected_status(exc: BaseException) -> int:
    """The status ``unexpected_answer`` gives an exception no handler took (the request metrics count it)."""
    if isinstance(exc, ClientDisconnect):
        return CLIENT_CLOSED_REQUEST
    return 503 if database_unavailable(exc) else 500


def unexpected_answer(
    method: str, route: str, request_id: str, exc: BaseException
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Log an exception no handler took and say what to answer: (status, JSON payload, headers).

    The database being unreachable, restarting or out of pooled connections is not a fault of the
    request nor a bug: 503 with Retry-After, so webhook senders and clients try again (a warning, as
    the outage itself is what to look at). A client that closed its request mid-body is no error of
    ours (anyone could fill the error log and the 5xx series with them): one INFO line, 499. Anything
    else is a 500 with the request id."""
    status = unexpected_status(exc)
    if status == CLIENT_CLOSED_REQUEST:
        logger.info("client closed %s %s mid-body (request %s)", method[:16], route, request_id)
        return status, {"detail": "the client closed the request", "request_id": request_id}, {}
    if status == 503:
        logger.warning(
            "database unavailable (%s) on %s %s (request %s): answered 503",
            type(exc).__name__,
            method[:16],
            route,
            request_id,
        )
        retry_after = str(UNAVAILABLE_RETRY_AFTER_SECONDS)
        payload = {"detail": "the database is unavailable; try again shortly", "request_id": request_id}
        return 503, payload, {"Retry-After": retry_after}
    log_unexpected(method, route, request_id, exc)
    return 500, {"detail": "internal error; the server log has the details", "request_id": request_id}, {}


class RequestIdMiddleware:
    """Gives each request an id (``X-Request-ID`` if the client sent a sane one), returns it on every
    answer, and turns anything unexpected into ``500 {"detail", "request_id"}``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope)
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        header = (REQUEST_ID_HEADER.lower().encode("ascii"), request_id.encode("ascii"))
        started = False

        async def send_with_id(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        with log_context(request_id=request_id):  # on every line logged for this request
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                status, payload, headers = unexpected_answer(
                    str(scope.get("method", "")), route_template(scope), request_id, exc
                )
                if started:  # the answer is already on its way: nothing more can be said
                    return
                extra = [(k.lower().encode("ascii"), v.encode("ascii")) for k, v in headers.items()]
                await send_json(send, status, payload, [header, *extra])


__all__ = [
    "REQUEST_ID_HEADER",
    "RequestIdMiddleware",
    "log_unexpected",
    "request_id_of",
    "route_template",
    "unexpected_answer",
    "unexpected_status",
]
