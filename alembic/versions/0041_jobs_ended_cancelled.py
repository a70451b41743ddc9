"""row_counts jobs_ended: a job cancelled because its subject was erased counts as cancelled, not failed

Revision ID: 0041
Revises: 0040
Create Date: 2026-12-06

Erasing a page or a transcript fails its pending jobs (``outbox.cancel_jobs``) in the erasure's
transaction, and the 0024 trigger counted each as "failed/<kind>": the FactmillJobsFailing alert, which
watches factmill_jobs_ended_total{status="failed"}, fired on a routine erasure, and steady erasure
traffic kept it firing over real failures. ``cancel_jobs`` now names its update (the transaction-local
setting ``factmill.job_ending``, set to "cancelled" around it and cleared after), and the trigger
counts what it names in place of the row's status. Endings counted before stay as they were counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0041"
down_revision: str | None = "0040"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# current_setting(..., true) is NULL when the setting was never made in the session, '' once cleared.
_COUNTED_AS = "coalesce(nullif(current_setting('factmill.job_ending', true), ''), NEW.status)"
_FUNCTION = """
CREATE OR REPLACE FUNCTION count_job_ending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO row_counts AS r (counter, label, backend, n)
    VALUES ('jobs_ended', {counted_as} || '/' || NEW.kind, pg_backend_pid(), 1)
    ON CONFLICT (counter, label, backend) DO UPDATE SET n = r.n + 1;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.execute(_FUNCTION.format(counted_as=_COUNTED_AS))


def downgrade() -> None:
    op.execute(_FUNCTION.format(counted_as="NEW.status"))
    # The cancellations counted go (the older collector exports no such status). Not folded into the
    # failures: the failed series would jump by every past erasure, and FactmillJobsFailing fire.
    op.execute("DELETE FROM row_counts WHERE counter = 'jobs_ended' AND label LIKE 'cancelled/%'")
