"""calibration: calibration_observations.compaction_id references compactions (ON DELETE SET NULL)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Observations were stored before the compactions table existed (0002), so compaction_id had no
foreign key and may hold ids of compactions that never existed or were deleted. Those are set to
NULL first (the observation itself, its coverage and label, stays: it still calibrates), then the
constraint is added. Deleting a compaction from now on clears the id in its observations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

logger = logging.getLogger("alembic.runtime.migration")

FK_NAME = "fk_calibration_observations_compaction_id_compactions"


def upgrade() -> None:
    # No writer may add a dangling id, or delete a compaction, between the clean-up and the check the
    # constraint makes (both run in this migration's transaction).
    op.execute("LOCK TABLE compactions, calibration_observations IN SHARE ROW EXCLUSIVE MODE")
    cleared = op.get_bind().execute(
        sa.text(
            "UPDATE calibration_observations AS o SET compaction_id = NULL "
            "WHERE o.compaction_id IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM compactions AS c WHERE c.id = o.compaction_id)"
        )
    )
    if cleared.rowcount:
        logger.warning(
            "%d calibration observation(s) named a compaction that does not exist; their compaction_id "
            "is now NULL",
            cleared.rowcount,
        )
    op.create_foreign_key(
        op.f(FK_NAME),
        "calibration_observations",
        "compactions",
        ["compaction_id"],
        ["id"],
        ondelete="SET NULL",
    )


def downgrade() -> None:
    # The ids cleared by upgrade() are not restored: they pointed nowhere.
    op.drop_constraint(op.f(FK_NAME), "calibration_observations", type_="foreignkey")
