"""Request body caps for Factmill's ASGI servers (the API and the MCP server's streamable HTTP):
a body over its cap is refused with 413 before, or as soon as, it passes the cap."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(send: Send, status: int, payload: dict[str, Any], headers: list[Any]) -> None:
    """Answer with ``payload`` as JSON (an ASGI response start and body)."""
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


class BodyTooLargeError(Exception):
    """The body passed the cap while a route read it (answered 413 by the API's handlers)."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.cap = cap


class BodyReadTimeoutError(Exception):
    """A large body did not arrive in time, or arrived slower than the least rate taken (answered 408 by
    the API's handlers): a slow upload would hold one of the few places large bodies have for as long
    as its sender liked."""

    def __init__(self, seconds: float, min_rate: int | None = None) -> None:
        super().__init__(seconds)
        self.seconds, self.min_rate = seconds, min_rate


def too_slow_detail(seconds: float, min_rate: int | None = None) -> str:
    if min_rate is not None:
        return (
            f"the request body arrived slower than {min_rate} bytes a second; send it again over a faster "
            "link, or in smaller requests"
        )
    return f"the request body did not arrive within {seconds:g} s; send it again, or in smaller requests"


# A large body's first seconds are not held to the least rate (a connection's slow start, a proxy's
# buffering); past them it must have come at least that fast on average.
LARGE_BODY_GRACE_SECONDS = 5.0


def too_large_detail(cap: int) -> str:
    return f"request body is over the {cap}-byte limit; send fewer or smaller pages per request"


async def _refused_by_declared_length(scope: Scope, send: Send, cap: int) -> bool:
    """Answer a request whose Content-Length is malformed (400) or over ``cap`` (413); True if it did."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            if not value.strip().isdigit():
                await send_json(send, 400, {"detail": "Content-Length must be a non-negative integer"}, [])
                return True
            if int(value) > cap:
                await send_json(send, 413, {"detail": too_large_detail(cap)}, [])
                return True
    return False


# A body past this many bytes is large: it is read, checked and parsed a few at a time.
LARGE_BODY_BYTES = 1024 * 1024
# The small bodies a process reads at once, by their declared bytes: past it the next waits for one of
# them to end. Counted by large requests alone, a sender with a forged signature header (checked
# for its form and age only before the body) kept hundreds of bodies just under 1 MiB in memory.
SMALL_BODIES_AT_ONCE_BYTES = 64 * LARGE_BODY_BYTES


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return 0


# When the request's head reached the server (epoch seconds), before it waited for a large-body place:
# a webhook signature's age is measured to this moment (worker.api.deps), not to when its route ran.
ARRIVED_AT_SCOPE_KEY = "factmill.arrived_at"
ARRIVED_MONOTONIC_SCOPE_KEY = "factmill.arrived_monotonic"  # the same moment, time.monotonic()


def arrived_at(scope: Scope, key: str = ARRIVED_AT_SCOPE_KEY) -> float | None:
    """When the request reached the body cap, by time.time() (``key``: ARRIVED_MONOTONIC_SCOPE_KEY, by
    time.monotonic()); None for one that did not pass through it."""
    value = scope.get(key)
    return value if isinstance(value, float) else None


def _large(scope: Scope) -> bool:
    """A request whose body is large, or of unknown length (chunked). Every header is read: h11 takes
    a chunked body sent with a Content-Length too, which, read first, let it past the large-body gate."""
    chunked = any(
        name.lower() == b"transfer-encoding" and b"chunked" in value.lower()
        for name, value in scope.get("headers", ())
    )
    return chunked or _declared_length(scope) > LARGE_BODY_BYTES


class BodyCapMiddleware:
    """Refuses a body over ``cap`` bytes before any of it is read: at once on its Content-Length, else
    as soon as the stream passes it (BodyTooLargeError, which the API's handlers answer with 413).
    Routes read smaller caps of their own on top (read_body).

    With ``large_at_once``, at most that many requests with a large body (over LARGE_BODY_BYTES, or
    chunked) are handled at a time; the others wait, their bodies unread (the server stops reading a
    socket whose buffer is full). Reading, signing and parsing a 25 MiB page body takes several times
    its size (the bytes, the text, the parsed JSON): ten at once passed an API pod's 512 MiB, and no
    credential is known before the body is read. A large body must then arrive within
    ``large_body_seconds`` (BodyReadTimeoutError, answered 408): two slow uploads held both places for
    as long as their senders liked, and every large ingestion waited behind them. And, after the first
    LARGE_BODY_GRACE_SECONDS, at least ``large_body_min_rate`` bytes a second on average: a forged
    signature header passes the checks made before the body (its form and age), and a trickle of a
    byte a second held a place for the whole deadline; two such connections, renewed, stalled every
    real large delivery. A small body is held to the same deadline and rate, from its first read, and
    waits for room once SMALL_BODIES_AT_ONCE_BYTES of small bodies are being read."""

    def __init__(
        self,
        app: ASGIApp,
        cap: int,
        large_at_once: int = 0,
        large_body_seconds: float | None = None,
        large_body_min_rate: int = 0,
    ) -> None:
        self.app, self.cap = app, cap
        self._large_gate = asyncio.Semaphore(large_at_once) if large_at_once > 0 else None
        self._large_body_seconds = large_body_seconds
        self._min_rate = large_body_min_rate
        self._small_bytes = 0  # declared bytes of the small bodies being read
        self._room = asyncio.Condition()  # notified as they end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault(ARRIVED_AT_SCOPE_KEY, time.time())
        scope.setdefault(ARRIVED_MONOTONIC_SCOPE_KEY, time.monotonic())
        if await _refused_by_declared_length(scope, send, self.cap):
            return
        if self._large_gate is not None and _large(scope):
            async with self._large_gate:
                await self.capped(scope, self._timed(receive), send)
            return
        length = _declared_length(scope) if self._large_gate is not None else 0
        if length:
            # Its own wait, for room in the budget (behind a large body's place, a 1 KB request waited
            # for an upload of up to two minutes to end).
            async with self._room:
                await self._room.wait_for(
                    lambda: self._small_bytes == 0 or self._small_bytes + length <= SMALL_BODIES_AT_ONCE_BYTES
                )
                self._small_bytes += length
        try:
            # A small body has the same time to arrive, from its first read (a wait for a thread is the
            # server's): unbounded, a request whose key was checked before its body came acted hours
            # later, the key revoked meanwhile (and held a connection all along).
            await self.capped(scope, self._timed(receive, from_first_read=True), send)
        finally:
            if length:
                async with self._room:
                    self._small_bytes -= length
                    self._room.notify_all()

    def _timed(self, receive: Receive, *, from_first_read: bool = False) -> Receive:
        """``receive``, raising BodyReadTimeoutError past ``large_body_seconds`` from now (or from the
        first read), or once the body has come slower than the least rate (after the grace seconds)."""
        seconds, min_rate = self._large_body_seconds, self._min_rate
        if seconds is None and min_rate <= 0:
            return receive
        deadline = asyncio.get_running_loop().time() + seconds if seconds is not None else float("inf")
        start: float | None = None  # the first read: the route may wait for a thread before it reads
        received = 0

        async def timed_receive() -> Any:
            nonlocal received, start, deadline
            if start is None:
                start = asyncio.get_running_loop().time()
                if from_first_read and seconds is not None:
                    deadline = start + seconds
            limit, slow = deadline, False
            if min_rate > 0:
                paced = start + LARGE_BODY_GRACE_SECONDS + received / min_rate
                limit, slow = min(deadline, paced), paced < deadline
            try:
                async with asyncio.timeout_at(limit):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeoutError(seconds or 0.0, min_rate if slow else None) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        return timed_receive

    async def capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app on a body stream that stops at the cap (a request with no or a small length)."""
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


class ForeignAppBodyCap(BodyCapMiddleware):
    """The body cap for an app whose error answers are its own (the MCP SDK's streamable HTTP, which
    answers any exception while reading a body with a 500): past ``cap`` bytes the app sees the client
    disconnect, so it acts on no part of the body, and whatever it answers then is replaced by the 413
    BodyCapMiddleware gives. Nothing is buffered here, and a request the app refuses before reading its
    body (no key: 401) is answered as the app says."""

    async def capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        total, over, answered = 0, False, False

        async def capped_receive() -> Any:
            nonlocal total, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.cap:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def refuse() -> None:
            nonlocal answered
            if not answered:
                answered = True
                await send_json(send, 413, {"detail": too_large_detail(self.cap)}, [])

        async def checked_send(message: Any) -> None:
            if over:
                await refuse()  # the app's own answer (an error about the "disconnect") is dropped
            else:
                await send(message)

        await self.app(scope, capped_receive, checked_send)
        if over:
            await refuse()


__all__ = [
    "LARGE_BODY_BYTES",
    "BodyCapMiddleware",
    "BodyReadTimeoutError",
    "BodyTooLargeError",
    "ForeignAppBodyCap",
    "send_json",
    "too_large_detail",
    "too_slow_detail",
]
