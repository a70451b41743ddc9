"""compaction: transcripts, their messages, and the compactions that summarize them

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "transcripts",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("context_window", sa.Integer(), nullable=True),
        sa.Column("reserve_tokens", sa.Integer(), server_default="16384", nullable=False),
        sa.Column("keep_recent_tokens", sa.Integer(), server_default="20000", nullable=False),
        sa.Column("tool_result_limit", sa.Integer(), server_default="2000", nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("length(id) BETWEEN 1 AND 200", name=op.f("ck_transcripts_id_length")),
        sa.CheckConstraint(
            "context_window IS NULL OR context_window > 0", name=op.f("ck_transcripts_context_window")
        ),
        sa.CheckConstraint("reserve_tokens >= 0", name=op.f("ck_transcripts_reserve_tokens")),
        sa.CheckConstraint("keep_recent_tokens >= 0", name=op.f("ck_transcripts_keep_recent_tokens")),
        sa.CheckConstraint("tool_result_limit >= 0", name=op.f("ck_transcripts_tool_result_limit")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transcripts")),
    )
    op.create_table(
        "transcript_messages",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("transcript_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), server_default="", nullable=False),
        sa.Column("tool_calls", postgresql.JSONB(astext_type=sa.Text()), server_default="[]", nullable=False),
        sa.Column("tool_call_id", sa.Text(), nullable=True),
        sa.Column("tool_name", sa.Text(), nullable=True),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("role IN ('user', 'assistant', 'tool')", name=op.f("ck_transcript_messages_role")),
        sa.CheckConstraint("seq >= 0", name=op.f("ck_transcript_messages_seq")),
        sa.CheckConstraint("tokens >= 0", name=op.f("ck_transcript_messages_tokens")),
        sa.ForeignKeyConstraint(
            ["transcript_id"],
            ["transcripts.id"],
            name=op.f("fk_transcript_messages_transcript_id_transcripts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transcript_messages")),
        sa.UniqueConstraint("transcript_id", "seq", name=op.f("uq_transcript_messages_transcript_id_seq")),
    )
    op.create_table(
        "compactions",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("transcript_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("cut_seq", sa.Integer(), nullable=False),
        sa.Column("previous_id", sa.BigInteger(), nullable=True),
        sa.Column("summary", sa.Text(), nullable=True),
        sa.Column("tokens_before", sa.Integer(), nullable=False),
        sa.Column("tokens_after", sa.Integer(), nullable=True),
        sa.Column("coverage", sa.Float(), nullable=True),
        sa.Column("density", sa.Float(), nullable=True),
        sa.Column("threshold_tau", sa.Float(), nullable=True),
        sa.Column("threshold_version", sa.Integer(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "missed_terms", postgresql.JSONB(astext_type=sa.Text()), server_default="[]", nullable=False
        ),
        sa.Column(
            "attempt_log", postgresql.JSONB(astext_type=sa.Text()), server_default="[]", nullable=False
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "status IN ('accepted', 'rejected', 'failed')", name=op.f("ck_compactions_status")
        ),
        sa.CheckConstraint(
            "coverage IS NULL OR (coverage >= 0 AND coverage <= 1)", name=op.f("ck_compactions_coverage")
        ),
        sa.CheckConstraint(
            "status <> 'accepted' OR (summary IS NOT NULL AND tokens_after IS NOT NULL)",
            name=op.f("ck_compactions_accepted_has_summary"),
        ),
        sa.ForeignKeyConstraint(
            ["transcript_id"],
            ["transcripts.id"],
            name=op.f("fk_compactions_transcript_id_transcripts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["previous_id"],
            ["compactions.id"],
            name=op.f("fk_compactions_previous_id_compactions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_compactions_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_compactions")),
    )
    op.create_index("ix_compactions_transcript_id_id", "compactions", ["transcript_id", "id"], unique=False)
    op.create_index(op.f("ix_compactions_job_id"), "compactions", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_compactions_job_id"), table_name="compactions")
    op.drop_index("ix_compactions_transcript_id_id", table_name="compactions")
    op.drop_table("compactions")
    op.drop_table("transcript_messages")
    op.drop_table("transcripts")
