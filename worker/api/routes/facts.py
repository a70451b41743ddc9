"""Reading pages and facts: GET /v1/pages (the stored pages, listed), GET
/v1/pages/{source_id}/{slug}/facts (one page's facts) and GET /v1/entities/{entity}/facts (one entity's
facts, as the MCP server's list_entity_facts); never the audit rows."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from models.reads import one_snapshot, read_only
from worker.access import AccessRefusedError, Principal, readable_sources
from worker.api.auth import Reader
from worker.api.deps import Context
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import EntityName, OffsetQuery, SourceIdQuery, StorableStr, page_address
from worker.api.routes.search import AS_OF_DESCRIPTION, INCLUDE_HISTORY_DESCRIPTION
from worker.consolidation.history import Lifecycle
from worker.core.facts import ENTITY_PATTERN
from worker.core.jsonvalues import INT4_MAX
from worker.extraction.catalog import (
    MAX_LISTED_PAGES,
    MAX_PAGE_CURSOR_LENGTH,
    PageList,
    list_pages,
    page_cursor,
)
from worker.extraction.facts import (
    ENTITY_CURSOR_PATTERN,
    EntityFactsPage,
    EntityNameError,
    FactCursorError,
    PageFactsPage,
    read_entity_facts,
    read_page_facts,
)
from worker.extraction.pages import MAX_SLUG_INPUT_LENGTH

facts_router = APIRouter(tags=["facts"])


def _readable(principal: Principal, source_id: str | None) -> tuple[str, ...] | None:
    try:
        return readable_sources(principal, source_id)
    except AccessRefusedError as exc:
        raise ApiError(403, str(exc)) from None


@facts_router.get(
    "/v1/pages",
    response_model=PageList,
    responses=error_responses(401, 403),
    summary="The stored pages, by source and slug, with their current facts and last extraction job",
    tags=["pages"],
)
def pages(
    ctx: Context,
    principal: Reader,
    source_id: SourceIdQuery = None,
    slug_prefix: Annotated[StorableStr | None, Query(max_length=MAX_SLUG_INPUT_LENGTH)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED_PAGES)] = 100,
    after: Annotated[
        StorableStr | None,
        Query(
            max_length=MAX_PAGE_CURSOR_LENGTH,
            json_schema_extra={"pattern": r"^[^|]+\|"},  # checked by list_pages (a 422)
            description="next_after of the previous answer: the pages after that one",
        ),
    ] = None,
) -> PageList:
    """A key limited to some sources lists only theirs; asking for another source is 403."""
    sources = _readable(principal, source_id)
    try:
        cursor = page_cursor(after)
    except ValueError as exc:
        raise ApiError(422, str(exc)) from None
    with read_only(ctx.factory) as session:
        return list_pages(session, source_ids=sources, slug_prefix=slug_prefix, limit=limit, after=cursor)


@facts_router.get(
    "/v1/pages/{source_id}/{slug:text}/facts",
    response_model=PageFactsPage,
    responses=error_responses(401, 403, 404),
    summary="The facts extracted from one page, in row order (current ones by default)",
)
def page_facts(
    request: Request,
    ctx: Context,
    principal: Reader,
    source_id: StorableStr,
    slug: StorableStr,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: OffsetQuery = 0,
    include_history: Annotated[bool, Query(description=INCLUDE_HISTORY_DESCRIPTION)] = False,
    as_of: Annotated[datetime | None, Query(description=AS_OF_DESCRIPTION)] = None,
    after_row_num: Annotated[
        int | None,
        Query(ge=-1, le=INT4_MAX, description="Only facts past this row: the next_after_row_num of a page"),
    ] = None,
) -> PageFactsPage:
    """A source id holding '/' is sent as %2F. Page by ``after_row_num`` (offset paging reads a fact
    twice, or skips one, when the page's facts change between two reads)."""
    source_id, slug = page_address(request, source_id, slug)
    _readable(principal, source_id)  # 403 for a source the key may not read
    # One snapshot: a re-extraction or an erasure committing between the page's read, the count and the
    # rows gave a total the facts disagreed with, or an erased page's empty list in place of a 404.
    with one_snapshot(ctx.factory) as session:
        found = read_page_facts(
            session,
            source_id,
            slug,
            limit=limit,
            offset=offset,
            lifecycle=Lifecycle(include_history, as_of),
            after_row_num=after_row_num,
        )
    if found is None:
        raise ApiError(404, f"no page {slug!r} in source {source_id!r}")
    return found


@facts_router.get(
    "/v1/entities/{entity:text}/facts",
    response_model=EntityFactsPage,
    responses=error_responses(401, 403, 422),
    summary="The facts about one entity, newest first (current ones by default)",
)
def entity_facts(
    ctx: Context,
    principal: Reader,
    entity: Annotated[
        EntityName,
        Path(
            description="The entity's slug (people/alice-example); a name is read with the slug rule",
            json_schema_extra={"pattern": ENTITY_PATTERN},
        ),
    ],
    source_id: SourceIdQuery = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: OffsetQuery = 0,
    include_history: Annotated[bool, Query(description=INCLUDE_HISTORY_DESCRIPTION)] = False,
    as_of: Annotated[datetime | None, Query(description=AS_OF_DESCRIPTION)] = None,
    after: Annotated[
        str | None,
        Query(
            max_length=40,
            json_schema_extra={"pattern": ENTITY_CURSOR_PATTERN},
            description="Only facts past this cursor: the next_after of a page",
        ),
    ] = None,
) -> EntityFactsPage:
    """An entity that has no facts (or none the key may read) answers an empty list, as a search would.
    A key limited to some sources reads only theirs; asking for another source is 403. Page by
    ``after`` (offset paging reads a fact twice, or skips one, when facts come or change meanwhile;
    the cursor is a fact's start, which consolidation may move while you page: a fact given an earlier
    start may come again (de-duplicate by id), and an undated one given a start may be missed; read from
    the start again for a complete list)."""
    sources = _readable(principal, source_id)
    with one_snapshot(ctx.factory) as session:
        try:
            return read_entity_facts(
                session,
                entity,
                source_ids=sources,
                limit=limit,
                offset=offset,
                lifecycle=Lifecycle(include_history, as_of),
                after=after,
            )
        except (EntityNameError, FactCursorError) as exc:
            raise ApiError(422, str(exc)) from None


__all__ = ["facts_router"]
