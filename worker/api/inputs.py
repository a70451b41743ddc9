"""Bounded input: a strict JSON loader for every body, and path/query types bounded to their columns.

Postgres refuses NUL in text and JSONB, lone surrogates cannot be encoded as UTF-8, NaN and the
infinities are not JSON, and an integer past its column's range fails inside the query: each of
these reaches the database as a 500 unless it is refused here, with a 422 naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Annotated, Any
from urllib.parse import unquote

from fastapi import Path, Query, Request
from pydantic import AfterValidator, BeforeValidator, Field, Strict
from starlette.convertors import PathConvertor, register_url_convertor

from worker.api.errors import ApiError
from worker.core.facts import MAX_ENTITY_NAME_CHARS, MAX_LIST_OFFSET, entity_slug, no_entity_slug
from worker.core.jsonvalues import BIGINT_MAX, INT4_MAX, json_integer, storable_text, text_problem
from worker.core.labels import MAX_SOURCE_ID_LENGTH, SOURCE_ID_PATTERN, check_source_id


class TextPathConvertor(PathConvertor):
    """``{name:text}``: the rest of a path, line breaks included. Starlette's ``path`` is ``.*``, which
    stops at a newline, so a slug or an entity holding one matched no route: an undocumented 404
    (bench/fuzz.py) instead of the handler's own answer (a 422 naming the rule, or an empty list)."""

    regex = "(?s:.*)"


# Registered as this module is imported: the route modules import it before their paths compile.
register_url_convertor("text", TextPathConvertor())

PAGES_PATH = "/v1/pages"


def _segment_after(raw: bytes, prefix: str) -> str | None:
    """The decoded raw-path segment that follows ``prefix`` (a decoded path), when the raw path's leading
    segments, each decoded, spell it (``/v1/%70ages`` is ``/v1/pages``: matched on the literal bytes,
    such a path fell back to Starlette's split); None when they do not."""
    spelled = ""
    for segment in raw.split(b"/")[1:]:
        if spelled == prefix:
            return unquote(segment.decode("ascii", "replace"))  # as the server decoded the path
        spelled += "/" + unquote(segment.decode("ascii", "replace"))
        if not prefix.startswith(spelled):
            return None
    return None


def page_address(request: Request, source_id: str, slug: str) -> tuple[str, str]:
    """The (source id, slug) a ``/v1/pages/{source_id}/{slug}...`` route names. Starlette matches routes
    on the decoded path, so a source id holding '/' (sent as %2F, as it must be) was split at its own
    '/': ``team%2Fa/notes`` named page ``a/notes`` of source ``team``, and DELETE erased that one. The
    source id is read from the raw path instead, whose first segment ends at the first real '/'; a path
    whose raw source leaves no slug (``/v1/pages/team%2Fa``) names no page (404)."""
    raw = request.scope.get("raw_path") or b""
    if not raw:  # a server that keeps no raw path: the decoded one is all there is
        return source_id, slug
    root = request.scope.get("root_path", "").rstrip("/")
    # Mounted under a prefix (uvicorn --root-path), the raw path holds it; a server may leave it out.
    named = next(
        (
            found
            for prefix in (root + PAGES_PATH, PAGES_PATH)
            if (found := _segment_after(raw, prefix)) is not None
        ),
        None,
    )
    if named is None:
        raise ApiError(404, "no page named: the path does not start with /v1/pages/")
    if named == source_id:
        return source_id, slug
    matched = f"{source_id}/{slug}"  # the decoded path Starlette split, which starts with the source
    if not matched.startswith(named + "/"):
        raise ApiError(404, f"no page named in source {named!r}: the path holds no slug after it")
    try:
        return check_source_id(named), matched[len(named) + 1 :]
    except ValueError as exc:
        raise ApiError(422, str(exc)) from None


class _NonFinite:
    """What NaN/Infinity (and a number past a double's range) parse to, so the walk can refuse them
    with the path that holds them."""

    def __init__(self, name: str, why: str = "is not a JSON number") -> None:
        self.name, self.why = name, why


def _refuse_constant(name: str) -> Any:
    return _NonFinite(name)


def _parse_float(text: str) -> Any:
    # 1e400 is valid JSON but past a double: Python reads it as inf, which no JSON encoder (nor the
    # JSONB column) takes, and storing it was a 500.
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text[:40], "is past the range of a 64-bit float")


def _json_path(path: list[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "body"


def _invalid(path: list[str | int], msg: str) -> ApiError:
    loc = _json_path(path)
    return ApiError(422, f"{loc}: {msg}", errors=[{"loc": loc, "msg": msg}])


# Objects and arrays nested deeper than this are refused. The parser's own limit is Python's recursion
# limit less the frames below it, and every later step that walks the value (the page's content hash,
# the JSONB encoder) recurses too: bodies nested 974-986 deep parsed, then failed as a 500.
MAX_JSON_DEPTH = 64
_TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays"


def _scalar_problem(node: Any) -> str | None:
    if isinstance(node, _NonFinite):
        return f"Input should be a finite number ({node.name} {node.why})"
    return text_problem(node) if isinstance(node, str) else None


def _members(node: dict[str, Any] | list[Any]) -> Iterator[tuple[str | int, Any]]:
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)


def check_json_text(data: Any, path: list[str | int] | None = None) -> None:
    """Raise a 422 naming the first string (key or value) holding NUL or a lone surrogate, NaN, or an
    object or array nested deeper than MAX_JSON_DEPTH.

    A walk of one iterator per open container, the path built only for an error: a stack of every
    member with its own path took about 90 times the body's size (a 25 MiB array of zeros, gigabytes)
    and 3.5 times as long."""
    where: list[str | int] = list(path or [])
    if not isinstance(data, dict | list):
        if problem := _scalar_problem(data):
            raise _invalid(where, problem)
        return
    open_containers = [_members(data)]
    while open_containers:
        for key, value in open_containers[-1]:
            if isinstance(key, str) and (problem := text_problem(key)):
                raise _invalid(where, f"a key {problem}")
            if isinstance(value, dict | list):
                if len(open_containers) >= MAX_JSON_DEPTH:
                    raise _invalid([*where, key], _TOO_DEEP)
                where.append(key)
                open_containers.append(_members(value))
                break  # into the container; this one's iterator resumes after it
            if isinstance(value, str | _NonFinite) and (problem := _scalar_problem(value)):
                raise _invalid([*where, key], problem)
        else:
            open_containers.pop()
            if open_containers:
                where.pop()


def strict_json_loads(body: bytes) -> Any:
    """``body`` as JSON, refusing what the store cannot hold: 422 with the JSON path of the problem.

    Refused: text that is not UTF-8, invalid JSON, NaN/Infinity, integers over 4,300 digits, objects
    and arrays nested deeper than MAX_JSON_DEPTH, and NUL or lone surrogates in any string or key.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(422, f"body is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        raise ApiError(
            422, f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise ApiError(422, "body is not usable JSON: it is nested too deeply") from None
    except ValueError as exc:  # NaN/Infinity, or an integer past Python's digit limit
        raise ApiError(422, f"body is not usable JSON: {exc}") from None
    check_json_text(data)
    return data


# A path or query string the store can hold (no NUL, no lone surrogate).
StorableStr = Annotated[str, AfterValidator(storable_text)]


# An entity a filter names: bounded before the storable check (a bound put on StorableStr is checked
# after it: the whole input scanned first, and "at most 1000 items after validation" said of text).
def _names_an_entity(value: str) -> str:
    """A name facts can be filed under (the rule they are stored by); a 422 naming the field, on every
    route alike (search answered 400 for what the entity route answered 422)."""
    if entity_slug(value) is None:
        raise ValueError(no_entity_slug(value))
    return value


EntityName = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ENTITY_NAME_CHARS),
    AfterValidator(storable_text),
    AfterValidator(_names_an_entity),
]

# A source id a client names (a filter, a backfill): the rule pages are stored under, so a source no
# page can have is a 422 naming the field, not an empty answer. The pattern reaches the document as
# JSON Schema only: the validator is what checks it.
_SOURCE_ID_SCHEMA: dict[str, Any] = {"pattern": SOURCE_ID_PATTERN}
SourceIdStr = Annotated[str, AfterValidator(storable_text), AfterValidator(check_source_id)]
SourceIdField = Annotated[
    SourceIdStr, Field(min_length=1, max_length=MAX_SOURCE_ID_LENGTH, json_schema_extra=_SOURCE_ID_SCHEMA)
]
SourceIdQuery = Annotated[
    SourceIdStr | None,
    Query(min_length=1, max_length=MAX_SOURCE_ID_LENGTH, json_schema_extra=_SOURCE_ID_SCHEMA),
]


# Path and query integers bounded to their columns: past them Postgres fails inside the query.
# A bigint id in a JSON body, an integer as JSON Schema means it (strict otherwise: no strings, no
# booleans). The bounds come before the validator so that they reach the document as minimum/maximum.
JsonBigIntId = Annotated[int, Strict(), Field(ge=1, le=BIGINT_MAX), BeforeValidator(json_integer)]

BigIntIdPath = Annotated[int, Path(ge=1, le=BIGINT_MAX)]
BigIntIdQuery = Annotated[int | None, Query(ge=1, le=BIGINT_MAX)]
OffsetQuery = Annotated[
    int,
    Query(
        ge=0,
        le=MAX_LIST_OFFSET,
        description=f"Skip this many (at most {MAX_LIST_OFFSET:,}: past it, page by the list's cursor).",
    ),
]


__all__ = [
    "BIGINT_MAX",
    "INT4_MAX",
    "PAGES_PATH",
    "BigIntIdPath",
    "BigIntIdQuery",
    "JsonBigIntId",
    "OffsetQuery",
    "SourceIdField",
    "SourceIdQuery",
    "SourceIdStr",
    "StorableStr",
    "check_json_text",
    "strict_json_loads",
    "text_problem",
]
