"""What a call can raise: one exception class per answer a caller acts on, carrying the server's detail.

The server answers every error as JSON ``{"detail": ..., **extra}`` (422s add ``errors``: a list of
``{"loc", "msg"}``; 500s add ``request_id``). ``ApiError`` keeps all of it; the subclasses let a caller
catch what it can handle: a bad key (``AuthenticationError``), a missing scope (``PermissionDenied``).
"""

from __future__ import annotations

import time
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any

import httpx


class FactmillError(Exception):
    """Anything the client raises."""


class ApiConnectionError(FactmillError):
    """No answer from the server (connection refused, reset or timed out) after every retry."""


class ApiError(FactmillError):
    """The server answered with an error status; ``detail`` is its message, ``body`` its whole answer."""

    def __init__(self, status_code: int, detail: str, body: dict[str, Any], headers: httpx.Headers) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.body = body
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from all four (pickle calls __init__ with the args alone): an error raised in a
        # process pool's worker reached the caller as a TypeError.
        return (type(self), (self.status_code, self.detail, self.body, self.headers))

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The problems a 422 lists, each ``{"loc": ..., "msg": ...}`` (empty for other errors)."""
        found = self.body.get("errors")
        return list(found) if isinstance(found, list) else []

    @property
    def retry_after(self) -> float | None:
        """Seconds the server asks to wait before trying again (429, and 503 while it is unavailable or
        a budget is spent), None when it named none."""
        return retry_after_seconds(self.headers)

    @property
    def request_id(self) -> str | None:
        """The id the server logged an unexpected error under (500s), for its operator."""
        found = self.body.get("request_id") or self.headers.get("x-request-id")
        return str(found) if found else None


class BadRequest(ApiError):
    """400: a malformed request (a bad query document, a bad Content-Length)."""


class AuthenticationError(ApiError):
    """401: no credential, an unknown or revoked key, or a webhook signature that does not verify."""


class PermissionDenied(ApiError):
    """403: the key lacks the route's scope, or may not read or write that source."""


class NotFound(ApiError):
    """404: no such job, page, transcript or config key (or one the key may not see)."""


class Conflict(ApiError):
    """409: the request clashes with the current state (a newer delivery, a job already queued) or with
    itself (one page named twice in a delivery: nothing of it was stored)."""


class PayloadTooLarge(ApiError):
    """413: the body is over the server's cap (FACTMILL_MAX_BODY_BYTES); send smaller batches."""


class UnprocessableEntity(ApiError):
    """422: the body or a parameter is invalid; ``errors`` names each field at fault."""


class RateLimited(ApiError):
    """429: this key's requests per minute are used up; ``retry_after`` says when to try again."""


class ServerError(ApiError):
    """5xx: the server failed (or is unavailable); retried before it is raised."""


class UnexpectedResponse(ApiError):
    """A success status whose body is not the answer the call expects (a proxy's or captive portal's
    page, a server of another version): ``detail`` says what did not fit, ``body`` keeps the first 500
    characters of what came back."""


def unexpected_response(response: httpx.Response, expected: str, problem: Exception) -> UnexpectedResponse:
    text = response.text[:500]
    detail = f"the answer is not {expected}: {type(problem).__name__}: {str(problem)[:300]}"
    return UnexpectedResponse(
        response.status_code, detail, {"detail": detail, "text": text}, response.headers
    )


BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: UnprocessableEntity,
    429: RateLimited,
}


def retry_after_seconds(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Retry-After as seconds from ``now`` (default: the clock), None when absent or unreadable. Factmill
    sends delta-seconds; a proxy or load balancer in front of it may send an HTTP-date (RFC 9110),
    which was taken as no header at all: a 503 "retry in an hour" was resent at once, three times."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):  # (an offset past any time zone)
        return None
    if when.tzinfo is None:  # "-0000": UTC by RFC 5322
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def error_for(response: httpx.Response) -> ApiError:
    """The exception for an error answer; a body that is not the server's JSON (a proxy's page) keeps
    its first 500 characters as the detail, and a JSON one without ``detail`` (a gateway's
    ``{"message": ...}``) its message: the detail read "None"."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"detail": response.text[:500] or response.reason_phrase}
    detail = body.get("detail")
    if detail is None:
        detail = body.get("message") or body.get("error") or response.text[:500] or response.reason_phrase
    text = detail if isinstance(detail, str) else str(detail)
    status = response.status_code
    cls = BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    return cls(status, text, body, response.headers)


__all__ = [
    "ApiConnectionError",
    "ApiError",
    "AuthenticationError",
    "BadRequest",
    "Conflict",
    "FactmillError",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "ServerError",
    "UnexpectedResponse",
    "UnprocessableEntity",
    "error_for",
    "unexpected_response",
]
