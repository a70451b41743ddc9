"""Reading the extracted facts back: a page's facts, an entity's facts (never the audit rows).

The API's facts route and the MCP server's tools both read through here, so what counts as a fact
(``is_audit`` false) and the order facts come in are decided once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict
from sqlalchemy import ColumnElement, Select, bindparam, func, select, text, tuple_, union_all
from sqlalchemy.orm import Session, defer

from models import Fact, page_id_of
from worker.consolidation.history import CURRENT_ONLY, Lifecycle
from worker.core.facts import entity_slug, no_entity_slug
from worker.core.jsonvalues import BIGINT_MAX
from worker.core.slugs import stored_form

# Columns no listing shows: a fact's vector is 256 floats parsed from text (about 1 µs each), 2.6 s of
# CPU for a page of 10,000 facts, read and thrown away; its search vector is the database's.
_UNSHOWN = (defer(Fact.embedding), defer(Fact.search_vector))


class FactRecord(BaseModel):
    """One extracted fact as readers see it."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    row_num: int
    fact: str
    kind: str
    entity_slug: str | None
    confidence: float
    notability: str
    context: str
    valid_from: datetime | None
    source: str
    source_session: str
    claim_metric: str | None
    claim_value: float | None
    claim_unit: str | None
    claim_period: str | None
    created_at: datetime
    # Lifecycle: current | superseded | duplicate; [valid_from, valid_to) is when it was true; the
    # fact that superseded it, or the one it repeats.
    status: str
    valid_to: datetime | None
    superseded_by: int | None
    duplicate_of: int | None


class PageFactsPage(BaseModel):
    """A page of one page's facts, in row order (``total`` counts them all)."""

    source_id: str
    slug: str
    page_id: int
    total: int
    facts: list[FactRecord]
    # Pass as after_row_num for the next page; None: this was the last. Paged by offset, facts a
    # re-extraction or a consolidation moved meanwhile were read twice or skipped.
    next_after_row_num: int | None = None


class EntityFact(FactRecord):
    """A fact about an entity, with the page it came from."""

    source_id: str
    source_markdown_slug: str


class EntityFactsPage(BaseModel):
    """A page of one entity's facts, newest first (``total`` counts them all)."""

    entity: str
    total: int
    facts: list[EntityFact]
    next_after: str | None = None  # pass as after for the next page; None: this was the last


class FactCursorError(ValueError):
    """An ``after`` cursor that is not of the form a page of an entity's facts answers."""


# Where a page of an entity's facts ended: its last fact's start in microseconds since the epoch (``n``:
# undated) and its id, e.g. ``1709251200000000:42``. Every string of this form is a place in the list (a
# start past datetime's range is taken as its bound), so the document's pattern states the rule exactly.
ENTITY_CURSOR_PATTERN = r"^(-?[0-9]{1,18}|n):[0-9]{1,18}$"
_ENTITY_CURSOR = re.compile(ENTITY_CURSOR_PATTERN.removeprefix("^").removesuffix("$"))  # fullmatch: no "\n"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def entity_cursor(fact: EntityFact) -> str:
    start = "n" if fact.valid_from is None else str((fact.valid_from - _EPOCH) // _MICROSECOND)
    return f"{start}:{fact.id}"


def _entity_cursor(after: str) -> tuple[datetime | None, int]:
    """The (valid_from, id) of the last fact a page listed (valid_from None: an undated one)."""
    if not _ENTITY_CURSOR.fullmatch(after):
        raise FactCursorError(f"after {after[:100]!r} is not a cursor this list answers (its next_after)")
    start, _, fact_id = after.partition(":")
    if start == "n":
        return None, int(fact_id)
    try:
        when = _EPOCH + int(start) * _MICROSECOND
    except OverflowError:
        when = (datetime.max if int(start) > 0 else datetime.min).replace(tzinfo=UTC)
    return when, int(fact_id)


def _entity_page(
    where: list[ColumnElement[bool]], after: str | None, offset: int, limit: int
) -> Select[Fact]:
    """One page of an entity's facts, newest first (undated last), in one statement: the dated ones
    past the cursor and the undated ones, two reads each bounded by the page and in the order of the
    index ix_facts_entity_timeline, merged. One ordered read over both read and sorted every fact of
    the entity (NULLS LAST is no order that index has), at every page."""
    when, last_id = _entity_cursor(after) if after is not None else (None, None)
    enough = min(offset + limit + 1, BIGINT_MAX)
    reads = []
    if after is None or when is not None:  # a cursor among the undated has passed every dated fact
        past = (
            []
            if when is None
            else [tuple_(Fact.valid_from, Fact.id) < tuple_(bindparam("when", when), last_id)]
        )
        dated = select(Fact.id, Fact.valid_from).where(*where, Fact.valid_from.is_not(None), *past)
        reads.append(dated.order_by(Fact.valid_from.desc(), Fact.id.desc()).limit(enough))
    past = [] if when is not None or last_id is None else [Fact.id < last_id]
    undated = select(Fact.id, Fact.valid_from).where(*where, Fact.valid_from.is_(None), *past)
    reads.append(undated.order_by(Fact.id.desc()).limit(enough))
    both = union_all(*reads).subquery()
    order = (both.c.valid_from.desc().nulls_last(), both.c.id.desc())
    page = select(both.c.id, both.c.valid_from).order_by(*order).offset(offset).limit(limit + 1).subquery()
    return (
        select(Fact)
        .options(*_UNSHOWN)
        .join(page, Fact.id == page.c.id)
        .order_by(page.c.valid_from.desc().nulls_last(), page.c.id.desc())
    )


def _lifecycle(lifecycle: Lifecycle) -> list[ColumnElement[bool]]:
    clause, params = lifecycle.clause(Fact.__tablename__)
    return [] if clause is None else [text(clause).bindparams(**params)]  # type: ignore[list-item]


def read_page_facts(
    session: Session,
    source_id: str,
    slug: str,
    *,
    limit: int = 1000,
    offset: int = 0,
    lifecycle: Lifecycle = CURRENT_ONLY,
    after_row_num: int | None = None,
) -> PageFactsPage | None:
    """The facts extracted from one page, in row order (current ones unless ``lifecycle`` says
    otherwise), past ``after_row_num`` when given; None when there is no such page. The slug is read
    in NFC, as slugs are stored."""
    slug = stored_form(slug)
    page_id = page_id_of(session, source_id, slug)
    if page_id is None:
        return None
    # Audit rows (the terminal EXTRACTION_COMPLETE marker) are bookkeeping, never facts.
    where = (
        Fact.source_id == source_id,
        Fact.source_markdown_slug == slug,
        Fact.is_audit.is_(False),
        *_lifecycle(lifecycle),
    )
    total = session.scalar(select(func.count()).select_from(Fact).where(*where)) or 0
    past = () if after_row_num is None else (Fact.row_num > after_row_num,)
    rows = list(
        session.scalars(
            select(Fact)
            .options(*_UNSHOWN)
            .where(*where, *past)
            .order_by(Fact.row_num)
            .offset(offset)
            .limit(limit + 1)
        )
    )
    facts = [FactRecord.model_validate(f) for f in rows[:limit]]
    more = len(rows) > limit
    return PageFactsPage(
        source_id=source_id,
        slug=slug,
        page_id=page_id,
        total=total,
        facts=facts,
        next_after_row_num=facts[-1].row_num if more else None,
    )


class EntityNameError(ValueError):
    """An entity filter with nothing the slug rule keeps (no letter or digit)."""


def entity_key(entity: str) -> str:
    """The entity slug a filter names (a slug, or a name the slug rule turns into one), or
    EntityNameError saying why it names none."""
    slug = entity_slug(entity)
    if slug is None:
        raise EntityNameError(no_entity_slug(entity))
    return slug


def read_entity_facts(
    session: Session,
    entity: str,
    *,
    source_ids: Sequence[str] | None = None,
    limit: int = 100,
    offset: int = 0,
    lifecycle: Lifecycle = CURRENT_ONLY,
    after: str | None = None,
) -> EntityFactsPage:
    """The facts about ``entity`` (its slug, or a name the slug rule turns into it), newest first,
    from ``source_ids`` only when given (current ones unless ``lifecycle`` says otherwise), past the
    ``after`` cursor when given. Raises EntityNameError when ``entity`` names no slug, FactCursorError
    for a cursor no page answered."""
    entity = entity_key(entity)
    where: list[ColumnElement[bool]] = [
        Fact.entity_slug == entity,
        Fact.is_audit.is_(False),
        *_lifecycle(lifecycle),
    ]
    if source_ids is not None:
        where.append(Fact.source_id.in_(list(source_ids)))
    total = session.scalar(select(func.count()).select_from(Fact).where(*where)) or 0
    rows = list(session.scalars(_entity_page(where, after, offset, limit)))
    facts = [EntityFact.model_validate(f) for f in rows[:limit]]
    more = len(rows) > limit
    return EntityFactsPage(
        entity=entity, total=total, facts=facts, next_after=entity_cursor(facts[-1]) if more else None
    )


__all__ = [
    "ENTITY_CURSOR_PATTERN",
    "EntityFact",
    "EntityFactsPage",
    "EntityNameError",
    "FactCursorError",
    "FactRecord",
    "PageFactsPage",
    "entity_key",
    "read_entity_facts",
    "read_page_facts",
]
