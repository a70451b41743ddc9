"""POST /v1/pages: the signed webhook that stores pages and queues their extraction.

A webhook stores its pages and jobs in one transaction and hands the job ids to the broker only
after that transaction committed, so a worker never looks for a row that is not there yet, and a
broker outage loses nothing (the sweeper re-sends).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from worker.api.auth import Admin, Ingest, PageIngester
from worker.api.deps import (
    ApiContext,
    Context,
    IdempotencyHeader,
    check_idempotency_key,
    json_request_body,
    load_json_body,
    read_body,
)
from worker.api.errors import ApiError, error_responses, problems_of, summarize
from worker.api.inputs import StorableStr, page_address
from worker.core.labels import listed_names
from worker.core.moments import SAME_SECOND_HINT, STORED_IN_ITS_SECOND_HINT
from worker.core.slugs import stored_form
from worker.deliveries import REPLAYED_HEADERS, Answer, deliver_once, replayed_answer, scoped_key
from worker.extraction.erase import erase_page, no_page_to_erase
from worker.extraction.pages import PageIn, StaleDeliveryError, page_changed, upsert_page
from worker.jobs import outbox

logger = logging.getLogger(__name__)

MAX_PAGES_PER_REQUEST = 1000

pages_router = APIRouter(tags=["pages"])


class JobAccepted(BaseModel):
    job_id: int
    source_id: str
    slug: str
    created: bool  # False: a pending job for this page already existed and will read the new content


class PageRef(BaseModel):
    source_id: str
    slug: str


class PagesAccepted(BaseModel):
    jobs: list[JobAccepted]
    unchanged: list[PageRef]


class PageErased(BaseModel):
    source_id: str
    slug: str
    facts_removed: int
    embeddings_removed: int
    checkpoints_removed: int
    audit_rows_removed: int
    jobs_cancelled: int  # pending extraction jobs of the page, now failed with "page erased"


def _pages_body_schema() -> dict[str, Any]:
    page = PageIn.model_json_schema()
    pages = {"type": "array", "items": page, "minItems": 1, "maxItems": MAX_PAGES_PER_REQUEST}
    return {
        "oneOf": [
            page,
            pages,
            {
                "type": "object",
                "properties": {"pages": pages},
                "required": ["pages"],
                "additionalProperties": False,
            },
        ]
    }


def _page_items(data: Any) -> tuple[list[Any], bool]:
    """The page objects of a parsed body, and whether it was a batch (a list or ``{"pages": [...]}``)."""
    batch = True
    if isinstance(data, list):
        items = data
    elif isinstance(data, dict) and "pages" in data:
        others = sorted(set(data) - {"pages"})
        if others:
            raise ApiError(422, f"unexpected field(s) next to 'pages': {listed_names(others)}")
        items = data["pages"]
        if not isinstance(items, list):
            raise ApiError(422, "pages: must be a list of page objects")
    elif isinstance(data, dict):
        items, batch = [data], False
    else:
        raise ApiError(422, 'body must be a page object, a list of pages, or {"pages": [...]}')
    if not items:
        raise ApiError(422, "pages: the list is empty; send at least one page")
    if len(items) > MAX_PAGES_PER_REQUEST:
        raise ApiError(
            422,
            f"pages: {len(items)} pages in one request; send at most {MAX_PAGES_PER_REQUEST} per request",
        )
    return items, batch


def parse_pages(body: bytes) -> list[PageIn]:
    """The pages in a webhook body: one page object, a list of them, or ``{"pages": [...]}``."""
    items, batch = _page_items(load_json_body(body))
    pages: list[PageIn] = []
    problems: list[dict[str, str]] = []
    for index, item in enumerate(items):
        try:
            pages.append(PageIn.model_validate(item))
        except ValidationError as exc:
            prefix = (f"pages[{index}]",) if batch else ()
            problems += problems_of(exc.errors(include_url=False), prefix)
    if problems:
        raise ApiError(422, summarize(problems), errors=problems[:100])
    seen: dict[tuple[str, str], int] = {}
    for index, page in enumerate(pages):  # the later copy replaced the earlier, both answered stored
        first = seen.setdefault((page.source_id, page.slug), index)
        if first != index:
            raise ApiError(  # each valid alone: the request conflicts with itself (409, not 422)
                409,
                f"pages[{index}]: the same page as pages[{first}] (source_id {page.source_id!r}, slug "
                f"{page.slug!r} once normalized); send each page once per request",
                source_id=page.source_id,
                slug=page.slug,
            )
    return pages


def store_pages(
    factory: sessionmaker[Session],
    pages: list[PageIn],
    key: str | None,
    body_hash: str,
    delivered_at: Callable[[Session], datetime] | None = None,
) -> tuple[dict[str, Any], list[tuple[int, str]], bool]:
    """Upsert the pages and request their jobs in ONE transaction.

    Returns (response, jobs to enqueue after the commit, replayed). A repeated delivery with the
    same Idempotency-Key returns the stored response and changes nothing. A page stored by a newer
    delivery than the date ``delivered_at`` gives this one in its transaction, or erased after it,
    raises StaleDeliveryError and nothing of the request is kept.
    """

    def write(session: Session) -> tuple[Answer, list[tuple[int, str]]]:
        # Lock pages in a fixed order so two overlapping batches cannot deadlock, every page before
        # anything a page's change locks (pages.page_changed); answer in request order.
        order = sorted(range(len(pages)), key=lambda i: (pages[i].source_id, pages[i].slug))
        at = None if delivered_at is None else delivered_at(session)
        changed = [i for i in order if upsert_page(session, pages[i], at).changed]
        results: list[outbox.JobRequest | None] = [None] * len(pages)
        for index in changed:
            results[index] = page_changed(session, pages[index])
        response = {
            "jobs": [
                {"job_id": r.job_id, "source_id": p.source_id, "slug": p.slug, "created": r.created}
                for p, r in zip(pages, results, strict=True)
                if r is not None
            ],
            "unchanged": [
                {"source_id": p.source_id, "slug": p.slug}
                for p, r in zip(pages, results, strict=True)
                if r is None
            ],
        }
        # Only a job this delivery created is sent: a pending one has its message already (a running
        # one reruns; a queued one waiting out a retry's backoff was sent at once on every delivery,
        # burning its attempts in seconds through an outage). A lost message is the sweeper's.
        pending = list(
            dict.fromkeys((r.job_id, outbox.EXTRACTION) for r in results if r is not None and r.created)
        )
        return response, pending

    response, pending = deliver_once(factory, key, body_hash, write)
    if pending is None:
        return response, [], True
    return response, pending, False


def accept_pages(ctx: ApiContext, body: bytes, ingest: Ingest, key: str | None) -> JSONResponse:
    """Verify, parse, store, commit, then enqueue (runs on a worker thread: all of it blocks)."""
    delivered_at = ingest.delivered_at(ctx, body)
    key = check_idempotency_key(key)
    body_hash = hashlib.sha256(body).hexdigest()
    delivery = scoped_key("POST /v1/pages", "", key, ingest.sender)
    try:
        pages = parse_pages(body)
    except ApiError:  # a rule tightened since this delivery was stored: its retry gets the stored answer
        prior = replayed_answer(ctx.factory, delivery, body_hash)
        if prior is None:
            raise
        return JSONResponse(prior, 202, headers=REPLAYED_HEADERS)
    ingest.check_sources(page.source_id for page in pages)
    try:
        response, pending, replayed = store_pages(ctx.factory, pages, delivery, body_hash, delivered_at)
    except StaleDeliveryError as exc:
        hint, retry = ingest.erased_in_its_second(
            exc.in_its_second, SAME_SECOND_HINT if exc.erased else STORED_IN_ITS_SECOND_HINT
        )
        detail = exc.described(signed=ingest.signature is not None) + hint
        raise ApiError(409, detail, headers=retry, source_id=exc.source_id, slug=exc.slug) from None
    if replayed:
        # The digest's head, as stored: the sender's key may name a person.
        logger.info("replayed webhook delivery %s", (delivery or "")[:12])
        return JSONResponse(response, 202, headers=REPLAYED_HEADERS)
    sent = ctx.enqueue(pending)
    logger.info(
        "accepted %s page(s): %s job(s), %s unchanged, %s sent to the broker",
        len(pages),
        len(response["jobs"]),
        len(response["unchanged"]),
        sent,
    )
    return JSONResponse(response, 202)


@pages_router.post(
    "/v1/pages",
    status_code=202,
    response_model=PagesAccepted,
    summary="Store pages and queue their extraction (signed webhook)",
    responses=error_responses(400, 401, 403, 409, 413, 422),
    openapi_extra=json_request_body(_pages_body_schema()),
)
async def post_pages(
    request: Request, ctx: Context, ingest: PageIngester, idempotency_key: IdempotencyHeader = None
) -> Response:
    """One page, a list of pages, or `{"pages": [...]}` (at most 1,000). Unchanged pages queue nothing.

    A page stored by a newer delivery (by signed timestamp) is not overwritten: 409 with the reason;
    so is a request that names one page twice (nothing of it is stored)."""
    body = await read_body(request, ctx.settings.max_body_bytes)
    return await run_in_threadpool(accept_pages, ctx, body, ingest, idempotency_key)


@pages_router.delete(
    "/v1/pages/{source_id}/{slug:text}",
    response_model=PageErased,
    summary="Erase a page and everything drawn from it (admin)",
    responses=error_responses(401, 403, 404),
)
def delete_page(
    request: Request, ctx: Context, admin: Admin, source_id: StorableStr, slug: StorableStr
) -> PageErased:
    """Remove the page, its facts, their embeddings, its checkpoints and its extraction audit rows in one
    transaction, and fail its pending jobs; one row in `erasures` records that it happened (no text).
    A source id holding '/' is sent as %2F."""
    source_id, slug = page_address(request, source_id, slug)
    slug = stored_form(slug)
    report = erase_page(ctx.factory, source_id, slug, requested_by=admin.actor)
    if report is None:
        raise ApiError(404, no_page_to_erase(ctx.factory, source_id, slug))
    ctx.enqueue(report.pending)
    return PageErased(source_id=source_id, slug=slug, **report.as_dict())


__all__ = [
    "MAX_PAGES_PER_REQUEST",
    "accept_pages",
    "delete_page",
    "pages_router",
    "parse_pages",
    "store_pages",
]
