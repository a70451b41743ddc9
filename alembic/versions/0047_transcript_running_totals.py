"""transcripts.message_count/message_tokens and compactions.tokens_cut: the context's size without a sum

Revision ID: 0047
Revises: 0046
Create Date: 2026-12-07

Each append summed the tokens of every message after the applied summary's cut (of every message when
there was none): 22 ms at 100k messages, 240 ms at a million (bench/transcript_append.py), on every
agent turn, under the transcript's row lock. Messages are only ever added (and erased with their
transcript), so running totals kept as messages are inserted stay exact; an accepted compaction keeps
the tokens of the messages its summary stands in for. Triggers keep both (every writer, the old release's
too); existing rows are filled from their messages here (a constant default first: no table rewrite).
The fill reads every stored message twice (the totals, then one ordered pass over the compacted
transcripts' messages for the cuts) while the new columns' locks hold every read and write of
transcripts and compactions off, and the trigger's holds appends off: about a quarter of a second per
million messages a pass (the scan bench/transcript_append.py timed before this migration), so run it
when a pause of that length is acceptable.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0047"
down_revision: str | None = "0046"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Kept by the database, so every writer keeps them: during a rolling upgrade the old release's appends
# and compactions (which know nothing of these columns) count too, and none is missed.
_COUNT_MESSAGES = """
CREATE FUNCTION count_transcript_messages() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE transcripts t
    SET message_count = t.message_count + added.n, message_tokens = t.message_tokens + added.tokens
    FROM (
        SELECT transcript_id, count(*) AS n, sum(tokens) AS tokens FROM new_rows GROUP BY transcript_id
    ) added
    WHERE t.id = added.transcript_id;
    RETURN NULL;
END $$
"""
_MEASURE_CUT = """
CREATE FUNCTION measure_compaction_cut() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'accepted' THEN
        NEW.tokens_cut := (
            SELECT COALESCE(sum(tokens), 0) FROM transcript_messages
            WHERE transcript_id = NEW.transcript_id AND seq < NEW.cut_seq
        );
    END IF;
    RETURN NEW;
END $$
"""


def upgrade() -> None:
    for table, column in (
        ("transcripts", "message_count"),
        ("transcripts", "message_tokens"),
        ("compactions", "tokens_cut"),
    ):
        op.add_column(table, sa.Column(column, sa.BigInteger(), nullable=False, server_default=sa.text("0")))
    # The triggers first: their locks hold writers off until this commits, so the fill below counts
    # every message committed before it, and the triggers every one after.
    op.execute(_COUNT_MESSAGES)
    op.execute(
        "CREATE TRIGGER count_transcript_messages AFTER INSERT ON transcript_messages "
        "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_transcript_messages()"
    )
    op.execute(_MEASURE_CUT)
    op.execute(
        "CREATE TRIGGER measure_compaction_cut BEFORE INSERT ON compactions "
        "FOR EACH ROW EXECUTE FUNCTION measure_compaction_cut()"
    )
    op.execute(
        "UPDATE transcripts t SET message_count = m.n, message_tokens = m.tokens "
        "FROM (SELECT transcript_id, count(*) AS n, sum(tokens) AS tokens FROM transcript_messages "
        "GROUP BY transcript_id) m WHERE m.transcript_id = t.id"
    )
    # One ordered pass over the messages of compacted transcripts (a sum of each head per compaction grew
    # with their lengths times their number); a cut past the last message stands for all of them.
    op.execute(
        "WITH running AS (SELECT transcript_id, seq, "
        "sum(tokens) OVER (PARTITION BY transcript_id ORDER BY seq) - tokens AS before "
        "FROM transcript_messages WHERE transcript_id IN "
        "(SELECT transcript_id FROM compactions WHERE status = 'accepted')) "
        "UPDATE compactions c SET tokens_cut = r.before FROM running r "
        "WHERE c.status = 'accepted' AND r.transcript_id = c.transcript_id AND r.seq = c.cut_seq"
    )
    op.execute(
        "UPDATE compactions c SET tokens_cut = t.message_tokens FROM transcripts t "
        "WHERE c.status = 'accepted' AND t.id = c.transcript_id AND NOT EXISTS "
        "(SELECT 1 FROM transcript_messages m WHERE m.transcript_id = c.transcript_id AND m.seq = c.cut_seq)"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER measure_compaction_cut ON compactions")
    op.execute("DROP FUNCTION measure_compaction_cut()")
    op.execute("DROP TRIGGER count_transcript_messages ON transcript_messages")
    op.execute("DROP FUNCTION count_transcript_messages()")
    op.drop_column("compactions", "tokens_cut")
    op.drop_column("transcripts", "message_tokens")
    op.drop_column("transcripts", "message_count")
