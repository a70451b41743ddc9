"""Erasing what was drawn from a page: its facts, their embeddings, its checkpoints (and, for an erasure,
the page itself), each time inside one transaction."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from sqlalchemy import bindparam, delete, func, literal_column, or_, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill, Erasure, ExtractionAudit, Fact, OpCheckpoint, Page, forget_page_in_deliveries
from models.tables import FACTS, LLM_CALLS, OP_CHECKPOINTS
from worker.accounting import forget_call_errors, forget_errors_of
from worker.config_store import EXTRACTION_PAGE_TYPES, get_config
from worker.consolidation import request_consolidation
from worker.consolidation.erasure import (
    REPLACED_REASON,
    forget_page_decisions,
    forget_reasons_about,
    page_facts,
    retire_unnamed_keys,
)
from worker.core.checkpoint import page_key
from worker.core.conversation import parse_conversation_messages, split_into_segments
from worker.core.erasure import erased_digest, erased_label, nothing_to_erase
from worker.db import made_again_on_deadlock
from worker.extraction.options import stored_page_types
from worker.jobs.outbox import EXTRACTION, cancel_jobs, page_subject

logger = logging.getLogger(__name__)

PAGE_ERASED = "page erased"
_HAS_VECTOR_STORE = text("SELECT to_regclass('search.fact_embeddings') IS NOT NULL")
_DELETE_VECTORS = text(
    "DELETE FROM search.fact_embeddings e USING facts f WHERE e.fact_id = f.id "
    "AND f.source_id = :source_id AND f.source_markdown_slug = :slug"
)


@dataclass(frozen=True)
class DerivedRemoved:
    """What went with a page's derived data: facts (audit markers not counted), embeddings, checkpoints."""

    facts: int
    embeddings: int
    checkpoints: int


@dataclass(frozen=True)
class ErasureReport:
    facts_removed: int
    embeddings_removed: int
    checkpoints_removed: int
    audit_rows_removed: int
    jobs_cancelled: int
    # Consolidation jobs for the entities whose facts pointed at the erased ones (superseded by one, a
    # duplicate of one): the caller sends them after the commit, and each puts those facts back.
    pending: list[tuple[int, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        """The counts (what the `erasures` row and the answer record), not the jobs to send."""
        return {name: count for name, count in asdict(self).items() if name != "pending"}


def page_body(compiled_truth: str, timeline: str) -> str:
    """The text extraction reads from a page: its compiled truth, then its timeline."""
    return compiled_truth + ("\n" + timeline if timeline else "")


def extracted_types(session: Session) -> tuple[str, ...]:
    """The page types extraction reads now (config `extraction.page_types`), read in this transaction."""
    return stored_page_types(get_config(session, EXTRACTION_PAGE_TYPES))


def is_extractable(page_type: str, body: str, types: Sequence[str]) -> bool:
    """Whether extraction would draw anything from the page: an extracted type with at least one segment
    (message lines, two or more of them close enough in time)."""
    if page_type not in types:
        return False
    return bool(split_into_segments(parse_conversation_messages(body)))


# One statement, built once: the webhook asks it of every changed page.
_HAS_DERIVED = select(
    or_(
        select(FACTS.c.id)
        .where(FACTS.c.source_id == bindparam("source_id"), FACTS.c.source_markdown_slug == bindparam("slug"))
        .exists(),
        select(OP_CHECKPOINTS.c.op).where(OP_CHECKPOINTS.c.page_key == bindparam("page_key")).exists(),
    )
)


def has_derived(session: Session, source_id: str, slug: str) -> bool:
    """Whether anything was drawn from the page (facts or a checkpoint): two indexed lookups, so storing
    a page that never had facts skips parsing it (up to ~2 s for a 25 MiB page)."""
    params = {"source_id": source_id, "slug": slug, "page_key": page_key(source_id, slug)}
    return bool(session.connection().execute(_HAS_DERIVED, params).scalar())


def erased_slug_digest(source_id: str, slug: str) -> str:
    """What the erasures table keeps instead of the slug (which can itself name a person)."""
    return erased_digest(source_id, slug)


def no_page_to_erase(factory: sessionmaker[Session], source_id: str, slug: str) -> str:
    """Why ``erase_page`` found nothing, for its caller to say (the API's 404, the CLI's error): no such
    page, and when it was erased if it was."""
    digest = erased_slug_digest(source_id, slug)
    with factory() as session:
        erased_at = session.scalar(
            select(func.max(Erasure.erased_at)).where(
                Erasure.source_id == source_id, Erasure.slug_sha256 == digest
            )
        )
    return nothing_to_erase(f"no page {slug!r} in source {source_id!r}", erased_at)


def drop_derived(session: Session, source_id: str, slug: str) -> DerivedRemoved:
    """Delete the page's facts, their embeddings and its checkpoints in the caller's transaction.

    The caller holds the page row locked (an upsert or ``FOR UPDATE``); an extraction commit takes it
    ``FOR SHARE`` first (ExtractionStore), so no commit can slip facts in after this and before the end.
    """
    keys = forget_reasons_about(session, page_facts(source_id, slug), REPLACED_REASON)
    if session.scalar(_HAS_VECTOR_STORE):
        # ON DELETE CASCADE would do it too; explicit, so nothing depends on how the table was built.
        session.execute(_DELETE_VECTORS, {"source_id": source_id, "slug": slug})
    removed = session.execute(
        delete(Fact)
        .where(Fact.source_id == source_id, Fact.source_markdown_slug == slug)
        .returning(Fact.is_audit, Fact.embedding.is_not(None))
    ).all()
    checkpoints = session.execute(
        delete(OpCheckpoint).where(OpCheckpoint.page_key == page_key(source_id, slug))
    ).rowcount  # type: ignore[attr-defined]
    retire_unnamed_keys(session, keys)
    return DerivedRemoved(
        facts=sum(not is_audit for is_audit, _ in removed),
        embeddings=sum(not is_audit and embedded for is_audit, embedded in removed),
        checkpoints=checkpoints,
    )


def cancel_page_jobs(session: Session, source_id: str, slug: str, reason: str = PAGE_ERASED) -> int:
    """Fail the page's pending extraction jobs with ``reason`` (``outbox.cancel_jobs``)."""
    return cancel_jobs(session, EXTRACTION, page_subject(source_id, slug), reason)


# The page's jobs keep their history (status, attempts, counts, times) but not its name: the slug in the
# subject becomes the erasure's digest, and so does the slug of the page's entry in their counters (its
# reason, which may quote it, goes), and a note becomes "page erased" (one may quote the slug, or a
# provider's message quoting the page); their calls' provider messages go too (forget_call_errors).
_FORGET_PAGE_IN_JOBS = text(
    """
    UPDATE jobs SET
        subject = :erased,
        last_error = CASE WHEN last_error IS NULL THEN NULL ELSE :note END,
        counters = CASE WHEN jsonb_typeof(counters -> 'pages') = 'array' THEN jsonb_set(counters, '{pages}', (
            SELECT coalesce(jsonb_agg(CASE WHEN entry ->> 'slug' = :slug
                THEN (entry - 'reason') || jsonb_build_object('slug', CAST(:name AS text))
                ELSE entry END ORDER BY n), '[]'::jsonb)
            FROM jsonb_array_elements(counters -> 'pages') WITH ORDINALITY AS e(entry, n)
        )) ELSE counters END
    WHERE kind = :kind AND subject = :subject
    """
)


def erased_name(source_id: str, slug: str) -> str:
    """What stands for an erased page's slug in its jobs: the erasure's digest."""
    return erased_label(source_id, slug)


def erased_subject(source_id: str, slug: str) -> str:
    """An erased page's jobs' subject: its source (a source-limited key still sees them), the digest."""
    return page_subject(source_id, erased_name(source_id, slug))


_FORGET_PAGE_IN_BACKFILLS = text("UPDATE backfill_requests SET slug = :name WHERE page_id = :page_id")


def backfills_of_the_page_alone(session: Session, source_id: str, slug: str) -> list[tuple[int, str, str]]:
    """The backfills whose filter names only erased pages once this one goes, locked, each with the
    filter's key and the erasure's name for it: a ``slug`` filter that is the slug, or a ``slug_prefix``
    that is this slug or one erased before, with no other page under it (a prefix of live pages is left:
    a backfill still planning would select none of them). Taken before the page's lock, in the order a
    backfill storing its plan takes them (its row, then its pages)."""
    found: list[tuple[int, str, str]] = []
    by_slug = func.normalize(Backfill.filters["slug"].astext, literal_column("NFC"))  # (NFD once)
    by_prefix = func.normalize(Backfill.filters["slug_prefix"].astext, literal_column("NFC"))
    held = (
        select(Backfill.id, by_slug, by_prefix)
        .where(Backfill.source_id == source_id, or_(by_slug == slug, func.starts_with(slug, by_prefix)))
        .order_by(Backfill.id)  # one statement, one order: two erasures take them alike
        .with_for_update(of=Backfill)
    )
    for backfill_id, named, prefix in session.execute(held).all():
        if named == slug:
            found.append((backfill_id, "slug", erased_name(source_id, slug)))
        # Read once the row is held: an erasure of the other last page under it, run at once, has
        # committed by then, and is seen gone (read in the locking statement, each saw the other).
        if (
            prefix is None
            or not slug.startswith(prefix)
            or _other_pages_under(session, source_id, prefix, slug)
        ):
            continue
        if prefix == slug or _erased(session, source_id, prefix):
            found.append((backfill_id, "slug_prefix", erased_name(source_id, prefix)))
    return found


def _other_pages_under(session: Session, source_id: str, prefix: str, slug: str) -> bool:
    under = select(Page.id).where(
        Page.source_id == source_id, func.starts_with(Page.slug, prefix), Page.slug != slug
    )
    return session.scalar(under.limit(1)) is not None


def _erased(session: Session, source_id: str, slug: str) -> bool:
    digest = erased_slug_digest(source_id, slug)
    return session.scalar(select(Erasure.id).where(Erasure.slug_sha256 == digest).limit(1)) is not None


def forget_page_name(
    session: Session, source_id: str, slug: str, page_id: int, backfills: Sequence[tuple[int, str, str]] = ()
) -> None:
    """Take the page's slug out of its extraction jobs, finished ones included, out of the requests
    backfills planned for it, and out of the answers kept for repeated webhook deliveries, in the
    caller's transaction (run after ``cancel_page_jobs``). A backfill then finds no page for those
    requests and drops them, as for any page erased under it. ``backfills``: those that asked for the
    page alone (``backfills_of_the_page_alone``), whose filter names it."""
    name = erased_name(source_id, slug)
    session.execute(_FORGET_PAGE_IN_BACKFILLS, {"name": name, "page_id": page_id})
    for backfill_id, key, erased in backfills:  # kept the slug: shown by backfill show, GET /v1/backfills
        named = Backfill.filters.op("||")(func.jsonb_build_object(key, erased))
        session.execute(update(Backfill).where(Backfill.id == backfill_id).values(filters=named))
    forget_page_in_deliveries(session, source_id, slug, name)
    session.execute(
        _FORGET_PAGE_IN_JOBS,
        {
            "erased": erased_subject(source_id, slug),
            "name": name,
            "slug": slug,
            "note": PAGE_ERASED,
            "kind": EXTRACTION,
            "subject": page_subject(source_id, slug),
        },
    )
    forget_call_errors(session, EXTRACTION, erased_subject(source_id, slug))


def erase_page(
    factory: sessionmaker[Session], source_id: str, slug: str, requested_by: str
) -> ErasureReport | None:
    """Erase the page and everything drawn from it in ONE transaction, leaving one content-free row in
    ``erasures``; None (nothing written) when there is no such page. The caller sends
    ``report.pending`` after this returns (the commit is done).

    A transaction Postgres ended to break a deadlock is made again (worker.db.made_again_on_deadlock):
    an erasure takes the page's dependent rows (facts, audit rows, calls) before its jobs, and a
    retention sweep's DELETE of an old job takes the job, then (its ON DELETE SET NULL) the rows naming
    it; when they met the other way round from the one the sweep gives way in (worker.jobs.maintenance),
    the erasure was a 500 to the admin."""
    return made_again_on_deadlock(_erase_page_once, factory, source_id, slug, requested_by)


def _erase_page_once(
    factory: sessionmaker[Session], source_id: str, slug: str, requested_by: str
) -> ErasureReport | None:
    with factory.begin() as session:
        backfills = backfills_of_the_page_alone(session, source_id, slug)
        page_id = session.scalar(
            select(Page.id).where(Page.source_id == source_id, Page.slug == slug).with_for_update()
        )
        if page_id is None:
            return None
        forget_page_decisions(session, source_id, slug, erased_name(source_id, slug))
        derived = drop_derived(session, source_id, slug)
        # The calls its audit rows name: a CLI run's or a backfill's are under no job of the page's.
        forget_errors_of(
            session,
            LLM_CALLS.c.id.in_(
                select(ExtractionAudit.llm_call_id).where(
                    ExtractionAudit.source_id == source_id, ExtractionAudit.page_slug == slug
                )
            ),
        )
        audit_rows = session.execute(
            delete(ExtractionAudit).where(
                ExtractionAudit.source_id == source_id, ExtractionAudit.page_slug == slug
            )
        ).rowcount  # type: ignore[attr-defined]
        report = ErasureReport(
            facts_removed=derived.facts,
            embeddings_removed=derived.embeddings,
            checkpoints_removed=derived.checkpoints,
            audit_rows_removed=audit_rows,
            jobs_cancelled=cancel_page_jobs(session, source_id, slug),
        )
        forget_page_name(session, source_id, slug, page_id, backfills)
        session.execute(delete(Page).where(Page.id == page_id))
        report.pending.extend(request_consolidation(session, source_id, slug))
        session.add(
            Erasure(
                source_id=source_id,
                slug_sha256=erased_slug_digest(source_id, slug),
                requested_by=requested_by,
                # Dated when written, the page's lock held: dated as its transaction began (now()), an
                # erasure that waited on a backfill's row was older than a delivery it then erased, and
                # that delivery sent again was stored again.
                erased_at=func.clock_timestamp(),
                **report.as_dict(),
            )
        )
    logger.info("erased page %s of source %s: %s", page_id, source_id, report.as_dict())
    return report


__all__ = [
    "PAGE_ERASED",
    "DerivedRemoved",
    "ErasureReport",
    "cancel_page_jobs",
    "drop_derived",
    "erase_page",
    "erased_name",
    "erased_slug_digest",
    "erased_subject",
    "extracted_types",
    "forget_page_name",
    "has_derived",
    "is_extractable",
    "no_page_to_erase",
    "page_body",
]
