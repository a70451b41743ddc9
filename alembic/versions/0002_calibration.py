"""calibration: observations and versioned thresholds

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibration_observations",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("coverage", sa.Float(), nullable=False),
        sa.Column("answer_kept", sa.Boolean(), nullable=False),
        sa.Column("origin", sa.Text(), nullable=False),
        sa.Column("compaction_id", sa.BigInteger(), nullable=True),
        sa.Column("dedupe_key", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "coverage >= 0 AND coverage <= 1", name=op.f("ck_calibration_observations_coverage")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_observations")),
        sa.UniqueConstraint("dedupe_key", name=op.f("uq_calibration_observations_dedupe_key")),
    )
    op.create_index(
        op.f("ix_calibration_observations_compaction_id"),
        "calibration_observations",
        ["compaction_id"],
        unique=False,
    )
    op.create_table(
        "calibration_thresholds",
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("tau", sa.Float(), nullable=True),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_recall", sa.Float(), nullable=False),
        sa.Column("min_observations", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("n_bad", sa.Integer(), nullable=False),
        sa.Column("max_observation_id", sa.BigInteger(), nullable=True),
        sa.Column("split_method", sa.Text(), nullable=False),
        sa.Column("calibration_n", sa.Integer(), server_default="0", nullable=False),
        sa.Column("calibration_n_bad", sa.Integer(), server_default="0", nullable=False),
        sa.Column("held_out_n", sa.Integer(), server_default="0", nullable=False),
        sa.Column("held_out_n_bad", sa.Integer(), server_default="0", nullable=False),
        sa.Column("held_out_accepted", sa.Integer(), server_default="0", nullable=False),
        sa.Column("held_out_rate", sa.Float(), nullable=True),
        sa.Column("active", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("trigger", sa.Text(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("computed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "NOT active OR tau IS NOT NULL", name=op.f("ck_calibration_thresholds_active_has_tau")
        ),
        sa.CheckConstraint("alpha > 0 AND alpha < 1", name=op.f("ck_calibration_thresholds_alpha")),
        sa.CheckConstraint(
            "held_out_rate IS NULL OR (held_out_rate >= 0 AND held_out_rate <= 1)",
            name=op.f("ck_calibration_thresholds_held_out_rate"),
        ),
        sa.CheckConstraint(
            "target_recall > 0 AND target_recall < 1", name=op.f("ck_calibration_thresholds_target_recall")
        ),
        sa.CheckConstraint(
            "tau IS NULL OR (tau >= 0 AND tau <= 1)", name=op.f("ck_calibration_thresholds_tau")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_calibration_thresholds_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_calibration_thresholds")),
    )
    op.create_index(
        "uq_calibration_thresholds_active",
        "calibration_thresholds",
        ["active"],
        unique=True,
        postgresql_where=sa.text("active"),
    )


def downgrade() -> None:
    op.drop_index("uq_calibration_thresholds_active", table_name="calibration_thresholds")
    op.drop_table("calibration_thresholds")
    op.drop_index(op.f("ix_calibration_observations_compaction_id"), table_name="calibration_observations")
    op.drop_table("calibration_observations")
