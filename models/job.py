"""Jobs: the outbox the webhook writes and the history operators read."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, Boolean, CheckConstraint, DateTime, Index, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, count_column, utcnow_column

JOB_STATUSES = ("queued", "running", "paused", "succeeded", "failed")
FINISHED = "status IN ('succeeded', 'failed')"
# A job still to run or running: at most one a subject (uq_jobs_pending_subject), kept with its budget's
# calls (models.llm_call.expire_ledger), what a new request for its subject finds (worker.jobs.outbox).
PENDING_STATUSES = ("queued", "running", "paused")
PENDING = f"status IN ({', '.join(repr(s) for s in PENDING_STATUSES)})"
# The source of a page job's subject `source|slug` (source ids never hold '|'), and what makes a job a
# page job: the expression and predicate of ix_jobs_page_source, which the job list filters on as written.
PAGE_SOURCE = "split_part(subject, '|', 1)"
PAGE_JOB = "kind = 'extraction'"


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"status IN ({', '.join(repr(s) for s in JOB_STATUSES)})", name="status"),
        Index("ix_jobs_status_kind", "status", "kind"),
        # A subject's jobs newest first (a page's latest extraction job, per listed page: migration 0048).
        Index("ix_jobs_subject_id", "kind", "subject", "id"),
        # At most one pending job per subject: a second delivery for a page that already has one
        # marks that job for a rerun instead of queueing a duplicate.
        Index(
            "uq_jobs_pending_subject",
            "kind",
            "subject",
            unique=True,
            postgresql_where=text(PENDING),
        ),
        # The finished jobs, oldest first, for expire_jobs (FACTMILL_JOB_RETENTION_DAYS).
        Index("ix_jobs_finished_at", "finished_at", postgresql_where=text(FINISHED)),
        # A source's page jobs newest first, for a source-limited key's job list: the expression is the
        # one worker.jobs.queries.job_list_query filters on (PAGE_SOURCE), so the planner matches it.
        Index(
            "ix_jobs_page_source",
            text(PAGE_SOURCE),
            text("id"),
            postgresql_where=text(PAGE_JOB),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str]
    subject: Mapped[str]
    options: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    status: Mapped[str] = mapped_column(server_default="queued")
    # Two budgets (worker.jobs.budgets): runs that reached a verdict of their own (capped by
    # FACTMILL_JOB_MAX_ATTEMPTS) and runs whose worker was lost (FACTMILL_JOB_MAX_WORKER_LOSSES).
    attempts: Mapped[int] = count_column()
    worker_losses: Mapped[int] = count_column()
    idempotency_key: Mapped[str | None] = mapped_column(unique=True)
    counters: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    last_error: Mapped[str | None]
    # Why a paused job waits: "kill_switch" (resumes when its switch is on) or "budget" (resumes when
    # the LLM budget has room again).
    pause_reason: Mapped[str | None]
    # The page changed while this job was running: run it again when it finishes.
    rerun_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    # Last time a message for this job was handed to the broker (the sweeper re-sends lost ones).
    enqueued_at: Mapped[datetime | None]
    # The W3C traceparent of the request that created the job (only while tracing is on): every send
    # of the job, the sweeper's included, joins that trace (worker.runtime.tracing).
    traceparent: Mapped[str | None]
    worker: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    # Where the job's own LLM budget (llm.budget_job_usd) counts from: its creation, moved on when a
    # rerun for new content or an operator's retry starts its budgets over. Counted from creation, a
    # job paused for its own budget held its page's one pending slot for good: every later delivery
    # merged into it, and a retry paused again at once.
    # Empty on jobs from before it (migration 0035): since their creation.
    budget_since: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=True
    )
    # When the LLM provider stopped serving the job (an outage, the account's money spent): the clock
    # FACTMILL_JOB_PROVIDER_OUTAGE_PATIENCE_SECONDS runs against (worker.jobs.lifecycle.wait_out_outage).
    # Empty while the provider serves it; an outage spends neither budget.
    provider_outage_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]


# Oldest first, SKIP LOCKED: as models.webhook.forget_deliveries. A job a backfill or a threshold
# version points at stays: the backfill reads its status from it, and the version names it as its
# provenance. Every other row pointing at a job (extraction audit rows, llm_calls, compactions,
# consolidation decisions) keeps its place with job_id NULL (ON DELETE SET NULL).
_EXPIRING = text(
    f"SELECT j.id FROM jobs j WHERE j.{FINISHED} AND j.finished_at < now() - :kept"
    " AND NOT EXISTS (SELECT FROM backfills b WHERE b.job_id = j.id)"
    " AND NOT EXISTS (SELECT FROM calibration_thresholds t WHERE t.job_id = j.id)"
    " ORDER BY j.finished_at LIMIT :limit FOR UPDATE OF j SKIP LOCKED"
)
# A call's job is how an erasure finds the provider's words on it (a message may quote the request: page
# text, a transcript): under no job, no erasure could, and they outlived what they were about. They go
# with the job (a refusal's already keep only their length).
EXPIRED_JOB_CALL_ERROR = "the provider's message went with the call's job (FACTMILL_JOB_RETENTION_DAYS)"
_FORGET_CALL_ERRORS = text(
    "UPDATE llm_calls SET error = :gone"
    " WHERE job_id = ANY(:ids) AND error IS NOT NULL AND outcome <> 'refusal'"
)
_DELETE = text("DELETE FROM jobs WHERE id = ANY(:ids)")


def expire_jobs(session: Session, kept: timedelta, limit: int) -> int:
    """Delete up to ``limit`` jobs that finished (succeeded or failed) longer than ``kept`` ago, oldest
    first, in the caller's transaction, with the provider's words on their calls; returns how many
    went."""
    ids = list(session.execute(_EXPIRING, {"kept": kept, "limit": limit}).scalars())
    if not ids:
        return 0
    session.execute(_FORGET_CALL_ERRORS, {"ids": ids, "gone": EXPIRED_JOB_CALL_ERROR})
    return session.execute(_DELETE, {"ids": ids}).rowcount  # type: ignore[attr-defined]
