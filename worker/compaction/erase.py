"""Erasing a transcript: its messages, its compactions (summaries), its jobs' name, in one transaction."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import BigInteger, column, delete, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import (
    Compaction,
    Transcript,
    TranscriptErasure,
    TranscriptMessageRow,
    forget_transcript_in_deliveries,
)
from models.tables import LLM_CALLS
from worker.accounting import forget_call_errors, forget_errors_of
from worker.core.erasure import erased_digest, erased_label, nothing_to_erase
from worker.core.moments import within_a_second
from worker.jobs.outbox import COMPACTION, cancel_jobs

logger = logging.getLogger(__name__)

TRANSCRIPT_ERASED = "transcript erased"

# Its compaction jobs keep their history (status, attempts, counts, times) but not its id, which is the
# client's own label and can name a person: the subject becomes the erasure's digest, a note becomes
# "transcript erased" (one may quote the id, or a provider's message quoting the transcript), counters
# older jobs kept of its id and words go, and so do their calls' provider messages (forget_call_errors).
_FORGET_TRANSCRIPT_IN_JOBS = text(
    """
    UPDATE jobs SET
        subject = :erased,
        last_error = CASE WHEN last_error IS NULL THEN NULL ELSE :note END,
        counters = counters - 'transcript_id' - 'detail' - 'missed_terms'
    WHERE kind = :kind AND subject = :transcript_id
    """
)


# The llm_calls its compactions' attempt logs name.
_LOGGED_CALLS = text(
    "SELECT (attempt ->> 'llm_call_id')::bigint AS id FROM compactions CROSS JOIN LATERAL "
    "jsonb_array_elements(CASE WHEN jsonb_typeof(attempt_log) = 'array' THEN attempt_log ELSE '[]' END) "
    "AS attempt WHERE transcript_id = :transcript_id AND jsonb_typeof(attempt -> 'llm_call_id') = 'number'"
).columns(column("id", BigInteger))


@dataclass(frozen=True)
class TranscriptErasureReport:
    messages_removed: int
    compactions_removed: int
    jobs_cancelled: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def erased_transcript_digest(transcript_id: str) -> str:
    """What the transcript_erasures row keeps instead of the id (which can itself name a person)."""
    return erased_digest(transcript_id)


class ErasedSinceSignedError(Exception):
    """A delivery signed before the transcript was erased: it must not create the transcript again.
    ``in_its_second``: both fall in one second (moments.SAME_SECOND_HINT, for a signed delivery)."""

    def __init__(self, signed_at: datetime, erased_at: datetime) -> None:
        super().__init__(
            f"this delivery (of {signed_at.isoformat()}) is older than the transcript's erasure "
            f"({erased_at.isoformat()}); send it again (freshly signed, if signed) to begin a new transcript"
        )
        self.in_its_second = within_a_second(signed_at, erased_at)


def refuse_if_erased_since(session: Session, transcript_id: str, signed_at: datetime) -> None:
    """ErasedSinceSignedError when ``transcript_id`` was erased after ``signed_at``: an append or a
    settings change signed before the erasure (late in transit, or a sender's retry of one that never
    arrived) began the transcript again with the erased messages, or went into the one begun after it.
    Asked after the write, in its transaction (which the error rolls back): an erasure committed while
    the write waited on the row it deleted is seen then."""
    erased_at = session.scalar(
        select(func.max(TranscriptErasure.erased_at)).where(
            TranscriptErasure.transcript_sha256 == erased_transcript_digest(transcript_id),
            TranscriptErasure.erased_at > signed_at,
        )
    )
    if erased_at is not None:
        raise ErasedSinceSignedError(signed_at, erased_at)


def no_transcript_to_erase(factory: sessionmaker[Session], transcript_id: str) -> str:
    """Why ``erase_transcript`` found nothing, for its caller to say: no such transcript, and when it was
    erased if it was."""
    with factory() as session:
        erased_at = session.scalar(
            select(func.max(TranscriptErasure.erased_at)).where(
                TranscriptErasure.transcript_sha256 == erased_transcript_digest(transcript_id)
            )
        )
    return nothing_to_erase(f"no transcript {transcript_id!r}", erased_at)


def erased_transcript_name(transcript_id: str) -> str:
    """What stands for an erased transcript's id in its jobs and in the answers kept for its appends."""
    return erased_label(transcript_id)


def _count(session: Session, model: type[TranscriptMessageRow] | type[Compaction], transcript_id: str) -> int:
    return (
        session.scalar(select(func.count()).select_from(model).where(model.transcript_id == transcript_id))
        or 0
    )


def erase_transcript(
    factory: sessionmaker[Session], transcript_id: str, requested_by: str
) -> TranscriptErasureReport | None:
    """Erase the transcript, its messages and its compactions in ONE transaction, fail its pending
    compaction jobs and take its id out of its jobs and kept answers, leaving one content-free row in
    ``transcript_erasures``; None (nothing written) when there is no such transcript. Calibration
    observations that judged one of its compactions stay, no longer naming it (their foreign key)."""
    with factory.begin() as session:
        found = session.scalar(select(Transcript.id).where(Transcript.id == transcript_id).with_for_update())
        if found is None:
            return None
        report = TranscriptErasureReport(
            messages_removed=_count(session, TranscriptMessageRow, transcript_id),
            compactions_removed=_count(session, Compaction, transcript_id),
            jobs_cancelled=cancel_jobs(session, COMPACTION, transcript_id, TRANSCRIPT_ERASED),
        )
        name = erased_transcript_name(transcript_id)
        session.execute(
            _FORGET_TRANSCRIPT_IN_JOBS,
            {"erased": name, "note": TRANSCRIPT_ERASED, "kind": COMPACTION, "transcript_id": transcript_id},
        )
        forget_call_errors(session, COMPACTION, name)
        # And the calls its compactions logged: `compact --now`'s are under no job.
        forget_errors_of(session, LLM_CALLS.c.id.in_(_LOGGED_CALLS.bindparams(transcript_id=transcript_id)))
        forget_transcript_in_deliveries(session, transcript_id, name)
        # Its messages and compactions go with it (ON DELETE CASCADE).
        session.execute(delete(Transcript).where(Transcript.id == transcript_id))
        session.add(
            TranscriptErasure(
                transcript_sha256=erased_transcript_digest(transcript_id),
                requested_by=requested_by,
                erased_at=func.clock_timestamp(),  # when written, its locks held (as a page's erasure)
                **report.as_dict(),
            )
        )
    logger.info("erased transcript %s: %s", name[:19], report.as_dict())  # the digest's head, not the id
    return report


__all__ = [
    "TRANSCRIPT_ERASED",
    "TranscriptErasureReport",
    "erase_transcript",
    "erased_transcript_digest",
    "erased_transcript_name",
    "no_transcript_to_erase",
]
