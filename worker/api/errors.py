"""API errors: ApiError, the one JSON error shape ``{"detail": ...}``, its handlers and OpenAPI entries."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.bodycap import BodyReadTimeoutError, BodyTooLargeError, too_large_detail, too_slow_detail
from worker.core.labels import quoted
from worker.deliveries import DeliveryKeyReusedError
from worker.guards import request_id_of, route_template, unexpected_answer
from worker.jobs.outbox import JobRequestContendedError

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 20
# What a 401 says may be sent instead (RFC 9110 asks every 401 for a challenge): an API key.
CHALLENGE = {"WWW-Authenticate": "Bearer"}


class ApiError(Exception):
    """An error the client caused (or can act on); becomes ``{"detail": ..., **extra}``."""

    def __init__(
        self, status_code: int, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail
        self.headers = headers
        self.extra = extra


class ErrorOut(BaseModel):
    detail: str


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route for these error status codes."""
    return {code: {"model": ErrorOut} for code in codes}


def location(loc: tuple[Any, ...] | list[Any]) -> str:
    """Pydantic's location as ``a.b.0``; a part longer than a name is quoted clipped (an unexpected key of
    a megabyte came back whole, twice)."""
    return ".".join(part if len(part) <= 80 else quoted(part) for part in map(str, loc)) or "body"


def problems_of(errors: Iterable[Mapping[str, Any]], prefix: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Pydantic's errors as ``{loc, msg}``; a validator's own message without pydantic's "Value error, "."""
    return [
        {
            "loc": location((*prefix, *e.get("loc", ()))),
            "msg": str(e.get("msg", "")).removeprefix("Value error, "),
        }
        for e in errors
    ]


def summarize(problems: list[dict[str, str]]) -> str:
    shown = "; ".join(f"{p['loc']}: {p['msg']}" for p in problems[:MAX_LISTED_PROBLEMS])
    if len(problems) > MAX_LISTED_PROBLEMS:
        shown += f" (and {len(problems) - MAX_LISTED_PROBLEMS} more)"
    return shown


def one_line(exc: BaseException) -> str:
    """An exception as one short line for a log or a health answer: its type and its first line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse({"detail": exc.detail, **exc.extra}, exc.status_code, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, BodyTooLargeError):
        # FastAPI turns any exception while it reads a model's body into "400 error parsing the body":
        # a chunked body past the cap on a route with a body model (POST /v1/backfills) said 400.
        return await _body_too_large(request, exc.__cause__)
    if isinstance(exc.__cause__, BodyReadTimeoutError):
        return await _body_too_slow(request, exc.__cause__)
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = problems_of(exc.errors())
    return JSONResponse({"detail": summarize(problems), "errors": problems}, 422)


async def _key_reused(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DeliveryKeyReusedError)
    return JSONResponse({"detail": str(exc)}, 422)


async def _body_too_large(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BodyTooLargeError)
    return JSONResponse({"detail": too_large_detail(exc.cap)}, 413)


async def _body_too_slow(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BodyReadTimeoutError)
    detail = too_slow_detail(exc.seconds, exc.min_rate)
    return JSONResponse({"detail": detail}, 408, headers={"Connection": "close"})


async def _job_contended(_: Request, exc: Exception) -> JSONResponse:
    # A subject's pending job finished on every round of the request (never in practice): nothing was
    # stored (the transaction rolled back), and the same request succeeds a moment later. A 500 said a
    # bug, and a sender might not have sent it again.
    assert isinstance(exc, JobRequestContendedError)
    detail = "a pending job of what this request changes kept finishing; nothing was stored, send it again"
    return JSONResponse({"detail": detail}, 503, headers={"Retry-After": "1"})


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # RequestIdMiddleware answers unexpected errors first; this is the fallback outside it.
    request_id = request_id_of(request.scope)
    route = route_template(request.scope)
    status, payload, headers = unexpected_answer(request.method, route, request_id, exc)
    return JSONResponse(payload, status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error answers JSON ``{"detail": ...}``, never a stack trace."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(BodyTooLargeError, _body_too_large)
    app.add_exception_handler(BodyReadTimeoutError, _body_too_slow)
    app.add_exception_handler(DeliveryKeyReusedError, _key_reused)
    app.add_exception_handler(JobRequestContendedError, _job_contended)
    app.add_exception_handler(Exception, _unexpected_error)


__all__ = [
    "ApiError",
    "ErrorOut",
    "add_error_handlers",
    "error_responses",
    "location",
    "one_line",
    "summarize",
]
