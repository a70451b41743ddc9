"""A backfill as asked for: which pages (the selection), stored with its batch_extraction job."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Backfill
from models.tables import PAGES
from worker.core.slugs import stored_form
from worker.extraction.erase import extracted_types
from worker.extraction.options import EXTRACTION_PAGE_TYPES, validate_since
from worker.jobs.outbox import request_job

BATCH_EXTRACTION = "batch_extraction"
WAITING_FOR_BATCHES = "batch"  # the pause reason of a job whose provider batches are still running
# The pause reason of one whose batches are at the provider while asking about or collecting them fails
# (its settings, its key, an outage): it waits on them as "batch" does, and an alert can tell it apart.
BATCH_FAULT = "batch_fault"


@dataclass(frozen=True)
class BackfillSelection:
    """Which pages a backfill extracts: a source, optionally narrowed; at most ``max_segments`` requests."""

    source_id: str = "default"
    since_iso: str | None = None
    slug_prefix: str | None = None
    max_segments: int | None = None
    slug: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        for name in ("slug_prefix", "slug"):  # as stored: a slug or prefix typed on a Mac may be NFD
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, stored_form(value))

    def as_filters(self) -> dict[str, object]:
        return {
            "since": self.since_iso,
            "slug_prefix": self.slug_prefix,
            "max_segments": self.max_segments,
            "slug": self.slug,
            "force": self.force,
        }

    @classmethod
    def of(cls, backfill: Backfill) -> BackfillSelection:
        f = backfill.filters
        return cls(
            backfill.source_id,
            f.get("since"),
            f.get("slug_prefix"),
            f.get("max_segments"),
            f.get("slug"),
            bool(f.get("force", False)),
        )


GONE = "gone"  # a batch's provider status when the provider answers 404 for it
# A batch cancelled already, or closing (OpenAI's finalizing: up to 10 minutes): no cancel is sent again.
WINDING_DOWN = frozenset({"cancelling", "canceling", "finalizing"})
# A batch whose send failed is sent again no sooner than this: a pass runs every poll (a minute) while
# other batches are in flight, and each failed upload may leave the pages' text at the provider.
RESEND_AFTER_SECONDS = 600.0


class BackfillNotFoundError(LookupError):
    """The job names a backfill that is not stored (its job fails; nothing to retry)."""


class BatchSendFailedError(RuntimeError):
    """A batch's send failed and no batch is left in flight to wait on: the job's own error, retried on
    its attempts (the sends already waited RESEND_AFTER_SECONDS apart), whatever the provider said."""


class NothingToBackfillError(LookupError):
    """No stored page of a type extraction reads matches the selection: a source or prefix typed wrong,
    pages not yet stored, or only pages of other types (config extraction.page_types)."""


def _matches_a_page(session: Session, selection: BackfillSelection, types: tuple[str, ...]) -> bool:
    """Whether a stored page the backfill would plan matches: of a type extraction reads (the planner
    lists no other), in the source, under the prefix or the slug."""
    query = select(PAGES.c.id).where(PAGES.c.source_id == selection.source_id, PAGES.c.type.in_(types))
    if selection.slug_prefix:
        query = query.where(PAGES.c.slug.startswith(selection.slug_prefix, autoescape=True))
    if selection.slug is not None:
        query = query.where(PAGES.c.slug == selection.slug)
    return session.execute(query.limit(1)).first() is not None


def backfill_subject(backfill_id: int) -> str:
    return f"backfill:{backfill_id}"


# The most segments one backfill may plan (the API's and the CLI's bound: one rule).
MAX_BACKFILL_SEGMENTS = 10_000_000


def request_backfill(
    session: Session, selection: BackfillSelection, created_by: str | None = None
) -> tuple[int, int]:
    """Store a backfill and request its batch_extraction job in the caller's transaction; returns
    (backfill id, job id): enqueue the job once that transaction commits."""
    validate_since(selection.since_iso, selection.force)
    if selection.max_segments is not None and not 1 <= selection.max_segments <= MAX_BACKFILL_SEGMENTS:
        raise ValueError(f"max_segments must be from 1 to {MAX_BACKFILL_SEGMENTS:,}")
    types = extracted_types(session)
    if not _matches_a_page(session, selection, types):
        narrowed = f" whose slug starts with {selection.slug_prefix!r}" if selection.slug_prefix else ""
        raise NothingToBackfillError(
            f"no page of a type extraction reads ({', '.join(types)}: config {EXTRACTION_PAGE_TYPES}) in "
            f"source {selection.source_id!r}{narrowed}: nothing to backfill (`factmill ingest` or "
            "POST /v1/pages stores pages)"
        )
    backfill = Backfill(source_id=selection.source_id, filters=selection.as_filters(), created_by=created_by)
    session.add(backfill)
    session.flush()
    job = request_job(
        session, BATCH_EXTRACTION, backfill_subject(backfill.id), options={"backfill": backfill.id}
    )
    backfill.job_id = job.job_id
    return backfill.id, job.job_id
