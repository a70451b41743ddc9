"""running totals: what /metrics reports of its growing tables, kept by triggers as rows change

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02

Every /metrics scrape aggregated whole tables: at a million rows each, llm_calls took 413 ms (two
aggregates), facts 330 ms (two), extraction_audit 143 ms, and jobs 29 ms at 125,000 (bench/metrics.py);
consolidation decisions, compactions and backfill requests grow the same way. At the goal's 128
segments a second these tables grow by about 11 million rows a day, so within days a scrape passes
its 5 s statement timeout and the metrics go dark. Statement-level triggers with
transition tables now keep running totals as rows are written, in the writing transaction (a rollback
takes its counts with it):

- ``job_totals``: jobs by status and kind, with the attempts and worker losses they spent (a gauge;
  an UPDATE that moves none of them, a heartbeat, writes nothing);
- ``llm_call_totals``: llm_calls by purpose and outcome (inserts only: counters), with token, cost and
  latency sums and the cumulative latency buckets of factmill_llm_latency_seconds;
- ``row_counts``: facts by status (audit rows excluded), compactions by status and the tokens the
  accepted ones saved, backfill requests by status (gauges: inserts, updates and deletes move them);
  segment attempts by outcome, consolidation decisions by decision and decider, and what backfill
  jobs' LLM calls cost (counters: inserts).

A row per writing backend (``pg_backend_pid()``), as llm_spend_days does, so concurrent commits never
wait on one counter row; the maintenance sweep folds the rows of backends that have gone into backend
0 (models.totals.fold_totals). TRUNCATE of a source table empties its totals. The latency bucket
bounds are worker.api.metrics.LLM_LATENCY_BUCKETS_MS, written out here as migrations do not import the
application (tests/integration/test_totals.py checks the two agree). Existing rows are counted here,
as backend 0, with the source tables locked against writers so nothing is counted twice or missed.
The skipped segments /metrics sums get a partial index over the few checkpoints that have any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import sqlalchemy as sa

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LATENCY_BUCKETS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000)
_LE = ", ".join(f"count(*) FILTER (WHERE latency_ms <= {ms})" for ms in LATENCY_BUCKETS_MS)
_PID = "pg_backend_pid()"

# The totals statements: {rows} is a SELECT of what to add (see _Source.rows), {backend} the row's owner.
_ROW_COUNTS = """
    INSERT INTO row_counts AS r (counter, label, backend, n)
    SELECT counter, label, {backend}, sum(n) FROM ({rows}) AS d(counter, label, n)
    GROUP BY counter, label HAVING sum(n) <> 0 ORDER BY counter, label
    ON CONFLICT (counter, label, backend) DO UPDATE SET n = r.n + EXCLUDED.n
"""
_JOB_TOTALS = """
    INSERT INTO job_totals AS t (status, kind, backend, jobs, attempts, worker_losses)
    SELECT status, kind, {backend}, sum(n), sum(a), sum(l) FROM ({rows}) AS d(status, kind, n, a, l)
    GROUP BY status, kind HAVING sum(n) <> 0 OR sum(a) <> 0 OR sum(l) <> 0 ORDER BY status, kind
    ON CONFLICT (status, kind, backend) DO UPDATE SET
        jobs = t.jobs + EXCLUDED.jobs,
        attempts = t.attempts + EXCLUDED.attempts,
        worker_losses = t.worker_losses + EXCLUDED.worker_losses
"""
_LLM_TOTALS = f"""
    INSERT INTO llm_call_totals AS t (purpose, outcome, backend, calls, input_tokens, output_tokens,
                                      cache_read_tokens, cost_usd, latency_ms, latency_le)
    SELECT purpose, outcome, {{backend}}, count(*), sum(input_tokens), sum(output_tokens),
           sum(cache_read_tokens), sum(cost_usd), sum(latency_ms), ARRAY[{_LE}]
    FROM ({{rows}}) AS d GROUP BY purpose, outcome ORDER BY purpose, outcome
    ON CONFLICT (purpose, outcome, backend) DO UPDATE SET
        calls = t.calls + EXCLUDED.calls,
        input_tokens = t.input_tokens + EXCLUDED.input_tokens,
        output_tokens = t.output_tokens + EXCLUDED.output_tokens,
        cache_read_tokens = t.cache_read_tokens + EXCLUDED.cache_read_tokens,
        cost_usd = t.cost_usd + EXCLUDED.cost_usd,
        latency_ms = t.latency_ms + EXCLUDED.latency_ms,
        latency_le = ARRAY(
            SELECT a + b FROM unnest(t.latency_le, EXCLUDED.latency_le) WITH ORDINALITY AS u(a, b, i)
            ORDER BY i
        )
"""


class _Source(NamedTuple):  # a NamedTuple: alembic loads migrations outside sys.modules, dataclasses need it
    """A table whose rows are counted: its trigger function, the totals statement, and ``rows``, a
    SELECT of what its rows add ({source}: the transition table, or the table to count what is there;
    {sign}: "-" for rows that went). A gauge moves with updates and deletes; a counter only with inserts.
    ``forget``: forget_totals()'s arguments, for a TRUNCATE of the table."""

    table: str
    function: str
    totals: str
    rows: str
    gauge: bool
    forget: str


SOURCES = (
    _Source(
        "jobs",
        "count_jobs",
        _JOB_TOTALS,
        "SELECT status, kind, {sign}1, {sign}attempts, {sign}worker_losses FROM {source}",
        gauge=True,
        forget="'job_totals'",
    ),
    _Source(
        "llm_calls",
        "count_llm_calls",
        _LLM_TOTALS,
        "SELECT purpose, outcome, input_tokens, output_tokens, cache_read_tokens, cost_usd, latency_ms "
        "FROM {source}",
        gauge=False,
        forget="'llm_call_totals'",
    ),
    _Source(  # what backfill (batch_extraction) jobs' calls cost, in micro-dollars: cost_usd has 6 places
        "llm_calls",
        "count_backfill_spend",
        _ROW_COUNTS,
        "SELECT 'backfill_cost_micro_usd', '', (c.cost_usd * 1000000)::bigint FROM {source} c "
        "JOIN backfills b ON b.job_id = c.job_id WHERE c.cost_usd > 0",
        gauge=False,
        forget="'row_counts', 'backfill_cost_micro_usd'",
    ),
    _Source(
        "facts",
        "count_facts",
        _ROW_COUNTS,
        "SELECT 'facts', status, {sign}1 FROM {source} WHERE NOT is_audit",
        gauge=True,
        forget="'row_counts', 'facts'",
    ),
    _Source(
        "extraction_audit",
        "count_segments",
        _ROW_COUNTS,
        "SELECT 'segments', outcome, 1 FROM {source}",
        gauge=False,
        forget="'row_counts', 'segments'",
    ),
    _Source(
        "consolidation_decisions",
        "count_decisions",
        _ROW_COUNTS,
        "SELECT 'decisions', decision || '/' || decided_by, 1 FROM {source}",
        gauge=False,
        forget="'row_counts', 'decisions'",
    ),
    _Source(
        "compactions",
        "count_compactions",
        _ROW_COUNTS,
        "SELECT 'compactions', status, {sign}1 FROM {source} UNION ALL "
        "SELECT 'compaction_tokens_saved', '', {sign}(tokens_before - tokens_after) FROM {source} "
        "WHERE status = 'accepted'",
        gauge=True,
        forget="'row_counts', 'compactions', 'compaction_tokens_saved'",
    ),
    _Source(
        "backfill_requests",
        "count_backfill_requests",
        _ROW_COUNTS,
        "SELECT 'backfill_requests', status, {sign}1 FROM {source}",
        gauge=True,
        forget="'row_counts', 'backfill_requests'",
    ),
)
COUNTERS = (
    "facts",
    "segments",
    "decisions",
    "compactions",
    "compaction_tokens_saved",
    "backfill_requests",
    "backfill_cost_micro_usd",
)


def _function(source: _Source) -> str:
    def add(rows: str) -> str:
        return source.totals.format(backend=_PID, rows=rows) + ";"

    inserted = add(source.rows.format(sign="", source="new_rows"))
    if not source.gauge:
        body = inserted
    else:
        deleted = add(source.rows.format(sign="-", source="old_rows"))
        # An update adds its new rows and takes away its old ones: one that moves nothing counted
        # (a job's heartbeat) comes to 0 everywhere and writes nothing.
        updated = add(
            source.rows.format(sign="", source="new_rows")
            + " UNION ALL "
            + source.rows.format(sign="-", source="old_rows")
        )
        body = (
            f"IF TG_OP = 'INSERT' THEN {inserted}\n"
            f"ELSIF TG_OP = 'DELETE' THEN {deleted}\n"
            f"ELSE {updated}\nEND IF;"
        )
    return (
        f"CREATE FUNCTION {source.function}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\n{body}\nRETURN NULL;\nEND $$"
    )


def _triggers(source: _Source) -> list[tuple[str, str]]:
    """(name, CREATE TRIGGER) of each trigger on the source table."""
    events = [("inserted", "INSERT", "NEW TABLE AS new_rows")]
    if source.gauge:
        events += [
            ("updated", "UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
            ("deleted", "DELETE", "OLD TABLE AS old_rows"),
        ]
    made = [
        (
            f"{source.function}_{event}",
            f"CREATE TRIGGER {source.function}_{event} AFTER {verb} ON {source.table} "
            f"REFERENCING {tables} FOR EACH STATEMENT EXECUTE FUNCTION {source.function}()",
        )
        for event, verb, tables in events
    ]
    made.append(
        (
            f"{source.function}_truncated",
            f"CREATE TRIGGER {source.function}_truncated AFTER TRUNCATE ON {source.table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION forget_totals({source.forget})",
        )
    )
    return made


# forget_totals(table): empty a totals table; forget_totals('row_counts', counter, ...): those counters.
_FORGET = """
CREATE FUNCTION forget_totals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_NARGS = 1 THEN
        EXECUTE format('DELETE FROM %I', TG_ARGV[0]);
    ELSE
        DELETE FROM row_counts WHERE counter = ANY (TG_ARGV[1:]);
    END IF;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.create_table(
        "row_counts",
        sa.Column("counter", sa.Text(), nullable=False),
        sa.Column("label", sa.Text(), nullable=False),
        sa.Column("backend", sa.Integer(), nullable=False),
        sa.Column("n", sa.BigInteger(), server_default="0", nullable=False),
        sa.CheckConstraint(
            "counter IN ({})".format(", ".join(f"'{c}'" for c in COUNTERS)),
            name=op.f("ck_row_counts_counter"),
        ),
        sa.PrimaryKeyConstraint("counter", "label", "backend", name=op.f("pk_row_counts")),
    )
    op.create_table(
        "llm_call_totals",
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("backend", sa.Integer(), nullable=False),
        sa.Column("calls", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cache_read_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cost_usd", sa.Numeric(18, 6), server_default="0", nullable=False),
        sa.Column("latency_ms", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("latency_le", sa.ARRAY(sa.BigInteger()), nullable=False),
        sa.PrimaryKeyConstraint("purpose", "outcome", "backend", name=op.f("pk_llm_call_totals")),
    )
    op.create_table(
        "job_totals",
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("backend", sa.Integer(), nullable=False),
        sa.Column("jobs", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("attempts", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("worker_losses", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("status", "kind", "backend", name=op.f("pk_job_totals")),
    )
    op.create_index(
        "ix_op_checkpoints_skipped",
        "op_checkpoints",
        ["page_key"],
        postgresql_where=sa.text("skipped <> '[]'::jsonb"),
    )
    tables = sorted({source.table for source in SOURCES} | {"backfills"})  # backfills: joined to calls
    op.execute("LOCK TABLE {} IN SHARE MODE".format(", ".join(tables)))
    op.execute(_FORGET)
    for source in SOURCES:
        op.execute(_function(source))
        for _, create in _triggers(source):
            op.execute(create)
        op.execute(source.totals.format(backend="0", rows=source.rows.format(sign="", source=source.table)))


def downgrade() -> None:
    for source in SOURCES:
        for name, _ in _triggers(source):
            op.execute(f"DROP TRIGGER {name} ON {source.table}")
        op.execute(f"DROP FUNCTION {source.function}()")
    op.execute("DROP FUNCTION forget_totals()")
    op.drop_index("ix_op_checkpoints_skipped", table_name="op_checkpoints")
    op.drop_table("job_totals")
    op.drop_table("llm_call_totals")
    op.drop_table("row_counts")
