"""transcripts.message_count/message_tokens and compactions.tokens_cut: the context's size without a sum

Revision ID: 0047
Revises: 0046
Create Date: 2026-12-07

Each append summed the tokens of every message after the applied summary's cut (of every message when
there was none): 22 ms at 100k messages, 240 ms at a million (bench/transcript_append.py), on every
agent turn, under the transcript's row lock. Messages are only ever added (and erased with their
transcript), so running totals kept by each append stay exact; an accepted compaction keeps the tokens
of the messages its summary stands in for. Existing rows are filled from their messages here (a
constant default first: no table rewrite).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0047"
down_revision: str | None = "0046"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table, column in (
        ("transcripts", "message_count"),
        ("transcripts", "message_tokens"),
        ("compactions", "tokens_cut"),
    ):
        op.add_column(table, sa.Column(column, sa.BigInteger(), nullable=False, server_default=sa.text("0")))
    op.execute(
        "UPDATE transcripts t SET message_count = m.n, message_tokens = m.tokens "
        "FROM (SELECT transcript_id, count(*) AS n, sum(tokens) AS tokens FROM transcript_messages "
        "GROUP BY transcript_id) m WHERE m.transcript_id = t.id"
    )
    op.execute(
        "UPDATE compactions c SET tokens_cut = COALESCE((SELECT sum(m.tokens) FROM transcript_messages m "
        "WHERE m.transcript_id = c.transcript_id AND m.seq < c.cut_seq), 0)"
    )


def downgrade() -> None:
    op.drop_column("compactions", "tokens_cut")
    op.drop_column("transcripts", "message_tokens")
    op.drop_column("transcripts", "message_count")
