"""transcript_erasures: one content-free row per erased transcript (DELETE /v1/transcripts/{id},
`factmill transcripts erase`)

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-04

Pages could be erased, transcripts (agent conversations, their tool output and summaries) could not.
The erasure deletes the transcript (its messages and compactions go with it by their foreign keys) and
leaves this row: the id's sha256, who asked, the counts, the time.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.Integer(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "transcript_erasures",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("transcript_sha256", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.Text(), nullable=False),
        _count("messages_removed"),
        _count("compactions_removed"),
        _count("jobs_cancelled"),
        sa.Column("erased_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transcript_erasures")),
    )
    op.create_index(
        op.f("ix_transcript_erasures_transcript_sha256"), "transcript_erasures", ["transcript_sha256"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_transcript_erasures_transcript_sha256"), table_name="transcript_erasures")
    op.drop_table("transcript_erasures")
