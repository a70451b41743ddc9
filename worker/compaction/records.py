"""Compaction rows in the caller's transaction: the record a run writes, a transcript's history of them.

A run's row is saved once, at its end (``save_compaction``); an accepted summary is applied only over
the one it was computed from, under the transcript's lock (``worker.compaction.queries``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from models import Compaction
from models.tables import COMPACTIONS, LLM_CALLS
from worker.accounting import forget_errors_of
from worker.compaction.queries import (
    ONE_RUN_OPTIONS,
    applied_summary,
    get_transcript,
    request_compaction,
    transcript_created_at,
)
from worker.compaction.waits import SUPERSEDED
from worker.core.paging import taken_within
from worker.jobs.leases import spend_one_run_options
from worker.jobs.outbox import JobRequestContendedError


@dataclass(frozen=True)
class CompactionRecord:
    """One compaction run as its row keeps it (the fields are the compactions columns, ``attempts`` aside)."""

    transcript_id: str
    status: str
    cut_seq: int
    previous_id: int | None
    tokens_before: int
    threshold_tau: float
    threshold_version: int | None
    attempt_log: list[dict[str, Any]]
    summary: str | None = None
    tokens_after: int | None = None
    coverage: float | None = None
    density: float | None = None
    missed_terms: list[str] = field(default_factory=list)
    error: str | None = None
    job_id: int | None = None
    head_capped: bool = False  # only the part of the head that fit the summarizer's input


@dataclass(frozen=True)
class SavedCompaction:
    """The stored row's id and final status: an accepted summary may have been superseded meanwhile;
    no row (id None) when the transcript was erased while the run worked."""

    compaction_id: int | None
    status: str
    error: str | None
    tokens_after: int | None


logger = logging.getLogger(__name__)

_INSERT_COMPACTION = insert(COMPACTIONS).returning(COMPACTIONS.c.id)


ERASED_MEANWHILE = "the transcript was erased while this compaction ran; nothing of it was recorded"


def save_compaction(
    session: Session,
    record: CompactionRecord,
    read_from: datetime | None = None,
    continue_forced: bool | None = None,
) -> SavedCompaction:
    """Insert a compaction row; an accepted one is applied only over the summary it was computed from.
    Nothing is written when the transcript the run read (created at ``read_from``) is gone, erased,
    or erased and begun again under its id: the row would hold the erased messages' summary.
    ``continue_forced`` (not None): an accepted row of part of the head requests the rest's
    compaction in this transaction (forced or not): requested after it, a worker that died in between
    left the rest waiting for the retrigger wait and an append."""
    # Appends and applies serialize on the transcript row.
    created = transcript_created_at(session, record.transcript_id, lock=True)
    if created is None or (read_from is not None and created != read_from):
        # The run's calls were recorded as it went, and no row of it will name them for the erasure
        # (`compact --now` has no job either): their provider messages go here.
        logged = [
            entry["llm_call_id"] for entry in record.attempt_log if isinstance(entry.get("llm_call_id"), int)
        ]
        if logged:
            forget_errors_of(session, LLM_CALLS.c.id.in_(logged))
        return SavedCompaction(None, "failed", ERASED_MEANWHILE, None)
    status, error = record.status, record.error
    if status == "accepted":
        # A summary computed from a timeline that another compaction replaced meanwhile must not be
        # applied over it.
        current = applied_summary(session, record.transcript_id)
        current_id = current.compaction_id if current else None
        if current_id != record.previous_id:
            status = "failed"
            error = (
                f"{SUPERSEDED} compaction {current_id} was accepted while this one ran, so this "
                "summary (of an older timeline) was not applied"
            )
    tokens_after = record.tokens_after if status != "failed" else None
    # (An accepted row's tokens_cut is measured by a trigger: migration 0047.)
    columns = asdict(record) | {"status": status, "error": error, "tokens_after": tokens_after}
    saved = session.connection().execute(_INSERT_COMPACTION, columns | {"attempts": len(record.attempt_log)})
    if record.job_id is not None:
        # The run's verdict is recorded with it: a run that takes the job over (its worker lost before
        # the job was finished) summarized the same head again, forced, and paid for it twice.
        spend_one_run_options(session, record.job_id, ONE_RUN_OPTIONS)
    if status == "accepted" and continue_forced is not None:
        try:  # a request that fails loses its continuation (an append asks again), not the summary
            with session.begin_nested():
                request_compaction(session, record.transcript_id, force=continue_forced, trigger="continue")
        except (SQLAlchemyError, JobRequestContendedError) as exc:
            logger.warning("compaction of part of a head: the rest's request failed (%s)", type(exc).__name__)
    return SavedCompaction(int(saved.scalar_one()), status, error, tokens_after)


# A page of compactions stops at this many bytes of summaries and attempt logs (at least one row): each
# row may carry a 16,384-character summary and two replies of as much in its log, so a page of 1,000
# built about 48 million characters as objects in the API for one request.
MAX_COMPACTIONS_PAGE_BYTES = 8 * 1024 * 1024
_ROW_BYTES = (  # as the answer holds them: uncompressed (pg_column_size counts the stored, compressed form)
    func.coalesce(func.octet_length(Compaction.summary), 0)
    + func.octet_length(cast(Compaction.attempt_log, Text))
    + func.octet_length(cast(Compaction.missed_terms, Text))
    + func.coalesce(func.octet_length(Compaction.error), 0)
)


def list_compactions(
    session: Session,
    transcript_id: str,
    *,
    limit: int = 50,
    before_id: int | None = None,
    max_bytes: int = MAX_COMPACTIONS_PAGE_BYTES,
) -> tuple[list[Compaction], bool]:
    """Compactions of a transcript, newest first (accepted, rejected and failed alike): up to ``limit``
    and ``max_bytes``; and whether more follow (older: ask with ``before_id``, the last one's id)."""
    get_transcript(session, transcript_id)
    mine = Compaction.transcript_id == transcript_id
    if before_id is not None:
        mine = mine & (Compaction.id < before_id)
    sizes = session.execute(
        select(Compaction.id, _ROW_BYTES).where(mine).order_by(Compaction.id.desc()).limit(limit + 1)
    ).all()
    taken = taken_within([size for _, size in sizes[:limit]], max_bytes)
    if not taken:
        return [], False
    oldest = sizes[taken - 1][0]
    rows = session.scalars(
        select(Compaction).where(mine, Compaction.id >= oldest).order_by(Compaction.id.desc())
    )
    return list(rows), len(sizes) > taken
