"""ASGI guards around the whole API: a request id on every answer, one 500 for anything unexpected
(logged as one line, no page text), and a body cap enforced before any route reads the body."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from worker.db import database_unavailable

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_SCOPE_KEY = "factmill.request_id"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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
    """The matched route's template (never the raw path, which may hold page slugs), else "unmatched"."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


def log_unexpected(method: str, route: str, request_id: str, exc: BaseException) -> None:
    """ONE line per unexpected error: no message (it may quote page text), no traceback but at DEBUG."""
    logger.error("unhandled %s on %s %s (request %s)", type(exc).__name__, method[:16], route, request_id)
    logger.debug("traceback of request %s", request_id, exc_info=exc)


# How long a client should wait before trying again while the database cannot serve.
UNAVAILABLE_RETRY_AFTER_SECONDS = 5


def unexpected_answer(
    method: str, route: str, request_id: str, exc: BaseException
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Log an exception no handler took and say what to answer: (status, JSON payload, headers).

    The database being unreachable, restarting or out of pooled connections is not a fault of the
    request nor a bug: 503 with Retry-After, so webhook senders and clients try again (a warning, as
    the outage itself is what to look at). Anything else is a 500 with the request id."""
    if database_unavailable(exc):
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


async def _send_json(send: Send, status: int, payload: dict[str, Any], headers: list[Any]) -> None:
    body = json.dumps(payload).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode("ascii")),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


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

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            status, payload, headers = unexpected_answer(
                str(scope.get("method", "")), route_template(scope), request_id, exc
            )
            if started:  # the answer is already on its way: nothing more can be said
                return
            extra = [(name.lower().encode("ascii"), value.encode("ascii")) for name, value in headers.items()]
            await _send_json(send, status, payload, [header, *extra])


class BodyTooLargeError(Exception):
    """The body passed the cap while a route read it (answered 413 by the API's handlers)."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.cap = cap


def too_large_detail(cap: int) -> str:
    return f"request body is over the {cap}-byte limit; send fewer or smaller pages per request"


class BodyCapMiddleware:
    """Refuses a body over ``cap`` bytes before any of it is read: at once on its Content-Length, else
    as soon as the stream passes it. Routes read smaller caps of their own on top (read_body)."""

    def __init__(self, app: ASGIApp, cap: int) -> None:
        self.app, self.cap = app, cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                if not value.strip().isdigit():
                    await _send_json(
                        send, 400, {"detail": "Content-Length must be a non-negative integer"}, []
                    )
                    return
                if int(value) > self.cap:
                    await _send_json(send, 413, {"detail": too_large_detail(self.cap)}, [])
                    return
        total = 0

        async def capped_receive() -> Any:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.cap:
                    raise BodyTooLargeError(self.cap)
            return message

        await self.app(scope, capped_receive, send)


__all__ = [
    "REQUEST_ID_HEADER",
    "BodyCapMiddleware",
    "BodyTooLargeError",
    "RequestIdMiddleware",
    "log_unexpected",
    "request_id_of",
    "route_template",
    "too_large_detail",
    "unexpected_answer",
]
