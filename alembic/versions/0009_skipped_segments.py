"""skipped (poison) segments: the audit columns that count a segment's permanent failures, the
checkpoint's list of segments it moved past, and the "skipped" audit outcome

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Existing audit rows get no segment hash, so failures recorded before this migration do not count
towards a skip; existing checkpoints skip nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_OUTCOMES = ("ok", "malformed_output", "truncated_output", "refusal", "provider_error", "budget_exhausted")
NEW_OUTCOMES = (*OLD_OUTCOMES, "skipped")


def _outcome_check(outcomes: tuple[str, ...]) -> None:
    op.drop_constraint(op.f("ck_extraction_audit_outcome"), "extraction_audit", type_="check")
    op.create_check_constraint(
        op.f("ck_extraction_audit_outcome"),
        "extraction_audit",
        f"outcome IN ({', '.join(repr(o) for o in outcomes)})",
    )


def upgrade() -> None:
    op.add_column("extraction_audit", sa.Column("segment_hash", sa.Text(), nullable=True))
    op.add_column(
        "extraction_audit", sa.Column("permanent", sa.Boolean(), server_default="false", nullable=False)
    )
    op.add_column("extraction_audit", sa.Column("reply", sa.Text(), nullable=True))
    _outcome_check(NEW_OUTCOMES)
    op.add_column(
        "op_checkpoints",
        sa.Column("skipped", postgresql.JSONB(astext_type=sa.Text()), server_default="[]", nullable=False),
    )


def downgrade() -> None:
    # A checkpoint's skipped list is the only record of the segments it moved past: dropped, their facts
    # were never extracted and nothing said which they were.
    op.execute("LOCK TABLE op_checkpoints IN EXCLUSIVE MODE")  # no worker adds one between count and drop
    skipping = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM op_checkpoints WHERE skipped <> '[]'"))
        .scalar_one()
    )
    if skipping:
        raise RuntimeError(
            f"{skipping} page checkpoint(s) list skipped segments: re-extract them (`factmill extract "
            "--skipped`) before downgrading past 0009, or they are forgotten; lists it cannot empty "
            "(an old fingerprint, a page edited since) are cleared knowingly with "
            "UPDATE op_checkpoints SET skipped = '[]'"
        )
    op.drop_column("op_checkpoints", "skipped")
    op.execute("DELETE FROM extraction_audit WHERE outcome = 'skipped'")
    _outcome_check(OLD_OUTCOMES)
    op.drop_column("extraction_audit", "reply")
    op.drop_column("extraction_audit", "permanent")
    op.drop_column("extraction_audit", "segment_hash")
