"""The retrigger wait: after a compaction missed (rejected, failed, or accepted and still over its
threshold), appends and the jobs they ask for wait FACTMILL_COMPACTION_RETRIGGER_SECONDS before another
summary of nearly the same head is paid for. Reads inside the caller's transaction."""

from __future__ import annotations

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from models import Compaction
from worker.core.transcripts import TranscriptSettings

# How the error of a run whose summary another accepted meanwhile begins (worker.compaction.records).
SUPERSEDED = "superseded:"


def recent_miss(
    session: Session,
    transcript_id: str,
    within_seconds: float,
    *,
    accepted_too: bool = False,
    accepted_over: int | None = None,
) -> Compaction | None:
    """The newest compaction, if it was rejected or failed (or accepted: always with ``accepted_too``,
    and with ``accepted_over`` when it left the context over that many tokens) less than
    ``within_seconds`` ago."""
    if within_seconds <= 0:
        return None
    # Its age by the database's clock, which dated it: a host clock ahead took a rejection of seconds
    # ago for an old one, and every append past the threshold paid for another summary.
    found = session.execute(
        select(
            Compaction,
            Compaction.created_at
            >= func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("within", within_seconds)),
        )
        .where(
            Compaction.transcript_id == transcript_id,
            # A run superseded by another's accepted summary judged nothing: newer by id than the
            # accepted one, it held appends (and the next jobs) back as a miss for the whole wait.
            ~((Compaction.status == "failed") & func.coalesce(Compaction.error, "").startswith(SUPERSEDED)),
        )
        .order_by(Compaction.id.desc())
        .limit(1)
    ).first()
    if found is None:
        return None
    newest, recent = found
    if newest.status == "accepted" and not accepted_too:
        # A part of a head too long for the summarizer leaves the context over by design: the rest is
        # next (its run may have found the agent's turn in flight and ended with nothing to compact).
        left_over = (
            accepted_over is not None
            and (newest.tokens_after or 0) > accepted_over
            and not newest.head_capped
        )
        if not left_over:
            return None
    if not recent:
        return None
    return newest


def retrigger_wait(missed: Compaction, retrigger_seconds: float) -> str:
    """Why no compaction runs now: the last one missed lately (FACTMILL_COMPACTION_RETRIGGER_SECONDS).
    It names no transcript: it is kept in the answers stored for repeated deliveries, where an erasure
    of the transcript would not find its id."""
    return (
        f"compaction {missed.id} was {missed.status} at {missed.created_at.isoformat()}; the next one "
        f"is requested {retrigger_seconds:g} s after it (force one: `factmill compact <transcript id>`)"
    )


def compaction_wait(
    session: Session, transcript_id: str, settings: TranscriptSettings, retrigger_seconds: float
) -> tuple[str | None, str | None]:
    """(why no compaction runs now, or None; why none can bring the context under its threshold, or
    None): the last compaction missed lately (rejected or failed), or was accepted lately and left the
    context over its threshold (its summary and the kept messages do not fit under it), or any accepted
    one lately when keep_recent_tokens alone does not fit. Without the wait, every append (and every
    rerun an append asked for) paid for another summary of nearly the same head. The request path and
    the job both ask it."""
    misfit: str | None = None
    if settings.trigger_tokens is not None and settings.keep_recent_tokens >= settings.trigger_tokens:
        misfit = (
            f"keep_recent_tokens ({settings.keep_recent_tokens}) is not below window - reserve "
            f"({settings.trigger_tokens}), so no compaction can bring this context under its threshold; "
            "lower keep_recent_tokens"
        )
    missed = recent_miss(
        session,
        transcript_id,
        retrigger_seconds,
        accepted_too=misfit is not None,
        accepted_over=settings.trigger_tokens,
    )
    if missed is None:
        return None, misfit
    if missed.status == "accepted" and misfit is None:
        misfit = (
            f"it left the context at {missed.tokens_after} tokens, over window - reserve "
            f"({settings.trigger_tokens}): its summary and keep_recent_tokens "
            f"({settings.keep_recent_tokens}) do not fit under it; lower keep_recent_tokens"
        )
    return retrigger_wait(missed, retrigger_seconds), misfit
