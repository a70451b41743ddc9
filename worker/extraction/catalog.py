"""The stored pages, listed: what was ingested, how many current facts each holds, and its last
extraction job (GET /v1/pages and `factmill pages list`). The caller owns the session."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy import ColumnElement, func, literal, select, true, tuple_
from sqlalchemy.orm import Session

from models.tables import FACTS, JOBS, PAGES
from worker.core.slugs import stored_form
from worker.jobs.outbox import EXTRACTION, page_subject_sql, split_page_subject

MAX_LISTED_PAGES = 1000
# A page cursor (next_after): a source id, '|', a slug as stored. A bound on the request's size only:
# sized by what a new slug may take, a longer one stored before that bound (or around the API; Postgres
# compresses a long key before its index's size check) made every listing stop at its page, the
# next_after it handed out refused by its own route.
MAX_PAGE_CURSOR_LENGTH = 16_384


class PageSummary(BaseModel):
    """One stored page: its name, what it is, its current facts and its last extraction job."""

    source_id: str
    slug: str
    type: str
    title: str
    updated_at: datetime
    facts: int
    last_job_id: int | None
    last_job_status: str | None


class PageList(BaseModel):
    pages: list[PageSummary]
    # The cursor of the next page of results (``source|slug`` of the last page listed), or None at the end.
    next_after: str | None


def _subject() -> ColumnElement[str]:
    """The extraction job subject of each page, in SQL."""
    return page_subject_sql(PAGES.c.source_id, PAGES.c.slug)


def page_cursor(after: str | None) -> tuple[str, str] | None:
    """The (source, slug) a listing's ``next_after`` names; ValueError when it is not one."""
    if after is None:
        return None
    if "|" not in after or after.startswith("|"):  # a source is never empty (the document's pattern)
        raise ValueError(f"after must be a source|slug (a listing's next_after), got {after!r}")
    return split_page_subject(after)


def list_pages(
    session: Session,
    *,
    source_ids: Sequence[str] | None = None,
    slug_prefix: str | None = None,
    limit: int = 100,
    after: tuple[str, str] | None = None,
) -> PageList:
    """Pages ordered by (source, slug), ``limit`` at most, from ``source_ids`` only when given, after the
    cursor ``after`` (the source and slug the previous list ended with, ``page_cursor``): the unique
    index's order, so a page stored meanwhile never shifts the pages already read."""
    facts = (
        select(func.count())
        .where(
            FACTS.c.source_id == PAGES.c.source_id,
            FACTS.c.source_markdown_slug == PAGES.c.slug,
            FACTS.c.is_audit.is_(False),
            FACTS.c.status == "current",
        )
        .scalar_subquery()
    )
    last_job = (
        select(JOBS.c.id, JOBS.c.status)
        .where(JOBS.c.kind == EXTRACTION, JOBS.c.subject == _subject())
        .order_by(JOBS.c.id.desc())
        .limit(1)
        .lateral()
    )
    query = (
        select(
            PAGES.c.source_id,
            PAGES.c.slug,
            PAGES.c.type,
            PAGES.c.title,
            PAGES.c.updated_at,
            facts.label("facts"),
            last_job.c.id.label("last_job_id"),
            last_job.c.status.label("last_job_status"),
        )
        .outerjoin(last_job, true())
        .order_by(PAGES.c.source_id, PAGES.c.slug)
        .limit(limit + 1)  # one past: a cursor only when there is more (a full last page led to an empty one)
    )
    if source_ids is not None:
        query = query.where(PAGES.c.source_id.in_(list(source_ids)))
    if slug_prefix:
        query = query.where(PAGES.c.slug.startswith(stored_form(slug_prefix), autoescape=True))
    if after is not None:
        source_id, slug = after
        position = tuple_(PAGES.c.source_id, PAGES.c.slug)
        query = query.where(position > tuple_(literal(source_id), literal(slug)))
    rows = session.execute(query).all()
    pages = [PageSummary.model_validate(row._mapping) for row in rows[:limit]]
    more = len(rows) > limit
    return PageList(pages=pages, next_after=f"{pages[-1].source_id}|{pages[-1].slug}" if more else None)


__all__ = [
    "MAX_LISTED_PAGES",
    "MAX_PAGE_CURSOR_LENGTH",
    "PageList",
    "PageSummary",
    "list_pages",
    "page_cursor",
]
