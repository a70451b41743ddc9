"""GET /v1/pages/{source_id}/{slug}/facts: the facts extracted from one page (never its audit rows)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select

from models import Fact, Page
from worker.api.auth import Reader
from worker.api.deps import Context
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import OffsetQuery, StorableStr

facts_router = APIRouter(tags=["facts"])


class FactOut(BaseModel):
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


class PageFacts(BaseModel):
    source_id: str
    slug: str
    page_id: int
    total: int
    facts: list[FactOut]


@facts_router.get(
    "/v1/pages/{source_id}/{slug:path}/facts",
    response_model=PageFacts,
    responses=error_responses(401, 403, 404),
    summary="The facts extracted from one page, in row order",
)
def page_facts(
    ctx: Context,
    principal: Reader,
    source_id: StorableStr,
    slug: StorableStr,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: OffsetQuery = 0,
) -> PageFacts:
    if not principal.sees(source_id):
        raise ApiError(403, f"this key may not read source {source_id!r}")
    with ctx.factory() as session:
        page_id = session.scalar(select(Page.id).where(Page.source_id == source_id, Page.slug == slug))
        if page_id is None:
            raise ApiError(404, f"no page {slug!r} in source {source_id!r}")
        # Audit rows (the terminal EXTRACTION_COMPLETE marker) are bookkeeping, never facts.
        where = (Fact.source_id == source_id, Fact.source_markdown_slug == slug, Fact.is_audit.is_(False))
        total = session.scalar(select(func.count()).select_from(Fact).where(*where)) or 0
        rows = session.scalars(select(Fact).where(*where).order_by(Fact.row_num).offset(offset).limit(limit))
        facts = [FactOut.model_validate(f) for f in rows]
    return PageFacts(source_id=source_id, slug=slug, page_id=page_id, total=total, facts=facts)


__all__ = ["facts_router"]
