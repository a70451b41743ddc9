"""GET and POST /v1/search: intent-aware search over the facts (worker.search behind HTTP)."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool
from starlette.concurrency import run_in_threadpool

from worker.access import AccessRefusedError, Principal
from worker.api.auth import Reader
from worker.api.deps import ApiContext, Context, json_request_body, parse_json_model, read_body
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import EntityName, SourceIdField, SourceIdQuery, StorableStr
from worker.core.facts import ENTITY_PATTERN, FactKind
from worker.core.intent import QueryParseError
from worker.core.jsonvalues import json_integer
from worker.llm.errors import BudgetExhaustedError
from worker.runtime import Runtime
from worker.search import (
    BUDGET_SPENT,
    MAX_INTENT_CHARS,
    MAX_LIMIT,
    MAX_QUERY_CHARS,
    MAX_SEARCH_LINES,
    EmbeddingFailedError,
    SearchError,
    SearchResult,
    VectorSearchUnavailableError,
    search_as,
)

logger = logging.getLogger(__name__)

# A search body is a query document of at most MAX_QUERY_CHARS and a few filters.
MAX_SEARCH_BODY_BYTES = 64 * 1024
KindName = FactKind


# A query document is a small language JSON Schema cannot state, so the document names it as a format
# and describes it; a malformed one is answered 400 with the line at fault.
QUERY_FORMAT: dict[str, Any] = {"format": "factmill-query"}
QUERY_DESCRIPTION = (
    "A plain query (one line), or a query document: one search per line, each starting with lex:, "
    "vec: or hyde: and holding text, plus at most one intent: line (then the intent field stays unset); "
    "a single expand: line asks for LLM expansion. Blank lines are ignored. A document that breaks "
    f"these rules, or holds more than {MAX_SEARCH_LINES} search lines, is refused with 400."
)


INCLUDE_HISTORY_DESCRIPTION = (
    "Also return superseded and duplicate facts (each with its status, interval and links); by "
    "default only current facts are returned."
)
AS_OF_DESCRIPTION = (
    "Only facts that were true at this ISO 8601 time (what was true then: a duplicate is never one, and "
    "include_history is not read beside it)."
)


ENTITY_DESCRIPTION = (
    "Only facts about this entity slug; a name is read with the slug rule (People/Zoë Ångström is "
    "people/zoë-ångström), so it needs a letter or digit."
)
ENTITY_FORMAT: dict[str, Any] = {"pattern": ENTITY_PATTERN}


class SearchBody(BaseModel):
    """A search: a plain query or a query document of lex:/vec:/hyde:/intent: lines."""

    model_config = ConfigDict(extra="forbid")

    q: StorableStr = Field(
        min_length=1,
        max_length=MAX_QUERY_CHARS,
        description=QUERY_DESCRIPTION,
        json_schema_extra=QUERY_FORMAT,
    )
    intent: StorableStr | None = Field(
        default=None, max_length=MAX_INTENT_CHARS, description="What the user is after."
    )
    source_id: SourceIdField | None = None
    entity: EntityName | None = Field(
        default=None, description=ENTITY_DESCRIPTION, json_schema_extra=ENTITY_FORMAT
    )
    kind: KindName | None = None
    since: datetime | None = Field(default=None, description="Only facts valid (or written) since then.")
    # JSON's own types (as FeedbackIn and transcripts): true is not a limit, nor "5" one. The bounds
    # sit before the validator so that they reach the document as minimum/maximum.
    limit: Annotated[int, Strict(), Field(ge=1, le=MAX_LIMIT), BeforeValidator(json_integer)] | None = None
    expand: StrictBool = Field(default=True, description="Let the LLM expand a plain query.")
    include_history: StrictBool = Field(default=False, description=INCLUDE_HISTORY_DESCRIPTION)
    as_of: datetime | None = Field(default=None, description=AS_OF_DESCRIPTION)


@dataclass
class SearchParams:
    """The query parameters of GET /v1/search: SearchBody's fields."""

    q: Annotated[
        StorableStr,
        Query(
            min_length=1,
            max_length=MAX_QUERY_CHARS,
            description=QUERY_DESCRIPTION,
            json_schema_extra=QUERY_FORMAT,
        ),
    ]
    intent: Annotated[StorableStr | None, Query(max_length=MAX_INTENT_CHARS)] = None
    source_id: SourceIdQuery = None
    entity: Annotated[
        EntityName | None, Query(description=ENTITY_DESCRIPTION, json_schema_extra=ENTITY_FORMAT)
    ] = None
    kind: KindName | None = None
    since: datetime | None = None
    limit: Annotated[int | None, Query(ge=1, le=MAX_LIMIT)] = None
    expand: bool = True
    include_history: Annotated[bool, Query(description=INCLUDE_HISTORY_DESCRIPTION)] = False
    as_of: Annotated[datetime | None, Query(description=AS_OF_DESCRIPTION)] = None


class SearchLineOut(BaseModel):
    type: str
    query: str
    origin: str
    weight: float
    line: int | None
    hits: int


class SearchResultOut(SearchResult):
    # The package's result value, under the schema name the API has always published.
    pass


class SearchOut(BaseModel):
    query: str
    intent: str | None
    structured: bool
    expanded: bool
    strong_signal: bool
    vector_search: str
    searches: list[SearchLineOut]
    results: list[SearchResultOut]
    took_ms: float
    notes: list[str]


class SearchErrorOut(BaseModel):
    detail: str


search_router = APIRouter(tags=["search"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": SearchErrorOut, "description": "A bad query document or filter; detail says what to fix."},
    501: {
        "model": SearchErrorOut,
        "description": "vec:/hyde: lines where vector search is unavailable: no pgvector, no embeddings "
        "API (Anthropic without an OpenAI key, an OpenAI-compatible server without "
        "FACTMILL_EMBEDDING_MODEL), incomplete LLM settings, or the provider refusing the deployment's "
        "key or model; no Retry-After (a plain query answers lexically instead).",
    },
    429: {
        "model": SearchErrorOut,
        "description": "This key's searches per minute are used; see Retry-After.",
    },
    503: {
        "model": SearchErrorOut,
        "description": "vec:/hyde: lines when the search LLM budget is spent or the embedding call "
        "failed; see Retry-After.",
    },
}


def run_search(runtime: Runtime, body: SearchBody, principal: Principal | None = None) -> dict[str, Any]:
    try:
        outcome = search_as(
            runtime,
            principal,
            body.q,
            intent=body.intent,
            source_id=body.source_id,
            entity=body.entity,
            kind=body.kind,
            since=body.since,
            limit=body.limit,
            expand=body.expand,
            include_history=body.include_history,
            as_of=body.as_of,
        )
    except AccessRefusedError as exc:
        raise ApiError(403, str(exc)) from None
    except QueryParseError as exc:
        raise HTTPException(400, detail=str(exc)) from None
    except VectorSearchUnavailableError as exc:
        raise HTTPException(501, detail=str(exc)) from None
    except SearchError as exc:
        raise HTTPException(400, detail=str(exc)) from None
    except BudgetExhaustedError:
        raise ApiError(503, BUDGET_SPENT, headers={"Retry-After": "3600"}) from None
    except EmbeddingFailedError as exc:
        raise ApiError(503, str(exc), headers={"Retry-After": "30"}) from None
    return outcome.as_dict()


def _limited(ctx: ApiContext, principal: Principal) -> None:
    """429 with Retry-After when this key has used its searches for the minute (each may call the LLM)."""
    limiter = ctx.search_limiter()
    verdict = limiter.hit(principal.rate_key)
    if not verdict.allowed:
        raise ApiError(
            429,
            f"too many searches for this key: at most {limiter.per_minute} a minute; retry later",
            headers={"Retry-After": str(verdict.retry_after)},
        )


def _running(ctx: ApiContext, principal: Principal) -> AbstractContextManager[None]:
    """429 when this key already has its searches running in this process (each holds a thread of the
    API's pool, maybe for a minute on the LLM): one key's burst took every thread, and every other
    tenant's request waited behind it."""
    running = ctx.searches_running()
    return running.held(
        principal.rate_key,
        lambda: ApiError(
            429,
            f"this key has {running.most} searches running; send the next one when one has answered",
            headers={"Retry-After": "1"},
        ),
    )


@search_router.get(
    "/v1/search",
    response_model=SearchOut,
    responses=_RESPONSES,
    summary="Search the facts (plain query or lex:/vec:/hyde:/intent: query document)",
)
def search_get(ctx: Context, principal: Reader, params: Annotated[SearchParams, Depends()]) -> dict[str, Any]:
    with _running(ctx, principal):  # first: a search refused for its running ones spends no minute's one
        _limited(ctx, principal)
        return run_search(ctx.runtime, SearchBody.model_validate(asdict(params)), principal)


@search_router.post(
    "/v1/search",
    response_model=SearchOut,
    responses={**_RESPONSES, **error_responses(413, 422)},
    summary="Search the facts, the query in a JSON body (handy for multi-line query documents)",
    openapi_extra=json_request_body(SearchBody.model_json_schema()),
)
async def search_post(request: Request, ctx: Context, principal: Reader) -> dict[str, Any]:
    body = parse_json_model(await read_body(request, MAX_SEARCH_BODY_BYTES), SearchBody)
    with _running(ctx, principal):  # taken before a thread is: a key over its share waits for none
        await run_in_threadpool(_limited, ctx, principal)
        return await run_in_threadpool(run_search, ctx.runtime, body, principal)


__all__ = ["SearchBody", "run_search", "search_router"]
