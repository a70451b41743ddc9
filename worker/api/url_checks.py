"""The request URL as a route reads it: UTF-8 once percent-decoded, and only the query parameters the
route declares, each at most once (an app-wide dependency).

FastAPI ignores a query parameter a route does not declare and keeps the last of a repeated one, so a
misspelled option did its default silently: ``POST /v1/jobs/7/retry?skiped=true`` retried without the
skipped segments and answered 202, ``?sourceid=a`` searched every source. The server decodes a
percent-escape that is not UTF-8 into U+FFFD, so ``caf%E9`` and ``caf%E8`` named one transcript and
two conversations were merged.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import unquote_to_bytes

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from worker.api.errors import ApiError
from worker.core.labels import listed_names


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters ``dependant`` and its dependencies read, by the names a client sends."""
    names = {field.alias for field in dependant.query_params}
    for dependency in dependant.dependencies:
        names |= _query_names(dependency)
    return frozenset(names)


def declared_query_names(route: APIRoute) -> frozenset[str]:
    """What ``route`` takes in its query string (a walk of a few dependants: microseconds a request)."""
    return _query_names(route.dependant)


def _refuse_unless_utf8(raw: bytes, what: str) -> None:
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400,
            f"the {what} is not UTF-8 once its percent-escapes are decoded ({exc.reason} at byte "
            f"{exc.start}): encode text as UTF-8 before escaping it",
        ) from None


async def check_request_url(request: Request) -> None:
    """400 for a path or query string that is not UTF-8 once decoded; 422 for a query parameter the
    route does not take, or one sent more than once, naming them and what the route takes."""
    _refuse_unless_utf8(request.scope.get("raw_path") or b"", "path")
    _refuse_unless_utf8(request.scope.get("query_string") or b"", "query string")
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    sent = Counter(name for name, _ in request.query_params.multi_items())
    known = declared_query_names(route)
    unknown = [name for name in sent if name not in known]
    if unknown:
        takes = ", ".join(sorted(known)) if known else "none"
        raise ApiError(422, f"unknown query parameter(s) {listed_names(unknown)}; this route takes {takes}")
    repeated = [name for name, count in sent.items() if count > 1]
    if repeated:
        raise ApiError(
            422, f"query parameter(s) {listed_names(repeated)} sent more than once: send each once"
        )


__all__ = ["check_request_url", "declared_query_names"]
