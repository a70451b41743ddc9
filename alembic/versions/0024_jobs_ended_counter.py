"""row_counts: jobs that ended, by status and kind, counted as each ends (a counter for alerts)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-04

The FactmillJobsFailing alert took ``increase()`` of factmill_jobs{status="failed"}, a gauge of the
failed jobs in the store. ``increase()`` reads any fall of a series as a counter reset and counts the
whole new value: retrying one failed job (failed -> queued), or the sweep deleting failed jobs past
FACTMILL_JOB_RETENTION_DAYS, fired the alert as if every remaining failed job had just failed. A
trigger now counts each job as it ends (its status becomes succeeded or failed) into row_counts
``jobs_ended``, labelled "status/kind"; nothing takes it back. /metrics exports it as
factmill_jobs_ended_total. A row trigger that fires only when a job's status becomes one of those (a
heartbeat or a claim does not run it). The jobs that had ended before are counted here as backend 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = (
    "facts",
    "segments",
    "decisions",
    "compactions",
    "compaction_tokens_saved",
    "backfill_requests",
    "backfill_cost_micro_usd",
)
AFTER = (*BEFORE, "jobs_ended")

# A row trigger that fires only as a job ends: a column list and a WHEN clause keep heartbeats and
# claims from running it (statement triggers with transition tables allow neither).
_FUNCTION = """
CREATE FUNCTION count_job_ending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO row_counts AS r (counter, label, backend, n)
    VALUES ('jobs_ended', NEW.status || '/' || NEW.kind, pg_backend_pid(), 1)
    ON CONFLICT (counter, label, backend) DO UPDATE SET n = r.n + 1;
    RETURN NULL;
END $$
"""
_EXISTING = """
    INSERT INTO row_counts (counter, label, backend, n)
    SELECT 'jobs_ended', status || '/' || kind, 0, count(*) FROM jobs
    WHERE status IN ('succeeded', 'failed') GROUP BY status, kind ORDER BY status, kind
"""


def _check(counters: Sequence[str]) -> None:
    op.drop_constraint(op.f("ck_row_counts_counter"), "row_counts", type_="check")
    op.create_check_constraint(
        op.f("ck_row_counts_counter"),
        "row_counts",
        "counter IN ({})".format(", ".join(f"'{c}'" for c in counters)),
    )


def upgrade() -> None:
    _check(AFTER)
    op.execute("LOCK TABLE jobs IN SHARE MODE")
    op.execute(_FUNCTION)
    op.execute(
        "CREATE TRIGGER count_job_endings_updated AFTER UPDATE OF status ON jobs FOR EACH ROW "
        "WHEN (NEW.status IN ('succeeded', 'failed') AND OLD.status IS DISTINCT FROM NEW.status) "
        "EXECUTE FUNCTION count_job_ending()"
    )
    op.execute(
        "CREATE TRIGGER count_job_endings_truncated AFTER TRUNCATE ON jobs "
        "FOR EACH STATEMENT EXECUTE FUNCTION forget_totals('row_counts', 'jobs_ended')"
    )
    op.execute(_EXISTING)


def downgrade() -> None:
    op.execute("DROP TRIGGER count_job_endings_truncated ON jobs")
    op.execute("DROP TRIGGER count_job_endings_updated ON jobs")
    op.execute("DROP FUNCTION count_job_ending()")
    op.execute("DELETE FROM row_counts WHERE counter = 'jobs_ended'")
    _check(BEFORE)
