"""running totals: what /metrics reports of jobs, facts, segments and LLM calls, kept by triggers

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02

Every /metrics scrape aggregated whole tables: at a million rows each, llm_calls took 413 ms (two
aggregates), facts 330 ms (two), extraction_audit 143 ms, and jobs 29 ms at 125,000 (bench/metrics.py).
At the goal's 128 segments a second those tables grow by about 11 million rows a day, so within days a
scrape passes its 5 s statement timeout and the metrics go dark. Statement-level triggers with
transition tables now keep running totals as rows are written, in the writing transaction (a rollback
takes its counts with it):

- ``row_counts``: facts by status (audit rows excluded; inserts, updates and deletes move it, it is a
  gauge) and extraction_audit rows by outcome (inserts only: a counter);
- ``job_totals``: jobs by status and kind, with the attempts and worker losses they spent (a gauge;
  an UPDATE that moves none of them, a heartbeat, writes nothing);
- ``llm_call_totals``: llm_calls by purpose and outcome (inserts only: counters), with token, cost and
  latency sums and the cumulative latency buckets of factmill_llm_latency_seconds.

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

import sqlalchemy as sa

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LATENCY_BUCKETS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000)
_LE = ", ".join(f"count(*) FILTER (WHERE latency_ms <= {ms})" for ms in LATENCY_BUCKETS_MS)

# {source}: the rows to add up; {backend}: the backend column's value.
_LLM_TOTALS = f"""
    INSERT INTO llm_call_totals AS t (purpose, outcome, backend, calls, input_tokens, output_tokens,
                                      cache_read_tokens, cost_usd, latency_ms, latency_le)
    SELECT purpose, outcome, {{backend}}, count(*), sum(input_tokens), sum(output_tokens),
           sum(cache_read_tokens), sum(cost_usd), sum(latency_ms), ARRAY[{_LE}]
    FROM {{source}} GROUP BY purpose, outcome ORDER BY purpose, outcome
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
# {counter}, {label}: what is counted and by what; {rows}: a SELECT of (label, n) to add.
_ROW_COUNTS = """
    INSERT INTO row_counts AS r (counter, label, backend, n)
    SELECT '{counter}', label, {backend}, sum(n) FROM ({rows}) AS d(label, n)
    GROUP BY label HAVING sum(n) <> 0 ORDER BY label
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
_JOBS = "SELECT status, kind, {sign}1, {sign}attempts, {sign}worker_losses FROM {source}"
_FACTS = "SELECT status, {sign} count(*) FROM {source} WHERE NOT is_audit GROUP BY status"
_SEGMENTS = "SELECT outcome, count(*) FROM {source} GROUP BY outcome"
_PID = "pg_backend_pid()"

_FUNCTIONS = f"""
CREATE FUNCTION count_llm_calls() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_LLM_TOTALS.format(source="new_rows", backend=_PID)};
    RETURN NULL;
END $$;

CREATE FUNCTION count_segments() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_ROW_COUNTS.format(counter="segments", backend=_PID, rows=_SEGMENTS.format(source="new_rows"))};
    RETURN NULL;
END $$;

CREATE FUNCTION count_facts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {_ROW_COUNTS.format(counter="facts", backend=_PID, rows=_FACTS.format(sign="", source="new_rows"))};
    ELSIF TG_OP = 'DELETE' THEN
        {_ROW_COUNTS.format(counter="facts", backend=_PID, rows=_FACTS.format(sign="-", source="old_rows"))};
    ELSE
        {
    _ROW_COUNTS.format(
        counter="facts",
        backend=_PID,
        rows=(
            _FACTS.format(sign="", source="new_rows")
            + " UNION ALL "
            + _FACTS.format(sign="-", source="old_rows")
        ),
    )
};
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {_JOB_TOTALS.format(backend=_PID, rows=_JOBS.format(sign="", source="new_rows"))};
    ELSIF TG_OP = 'DELETE' THEN
        {_JOB_TOTALS.format(backend=_PID, rows=_JOBS.format(sign="-", source="old_rows"))};
    ELSE  -- a heartbeat moves none of these: the sums come to 0 and nothing is written
        {
    _JOB_TOTALS.format(
        backend=_PID,
        rows=(
            _JOBS.format(sign="", source="new_rows")
            + " UNION ALL "
            + _JOBS.format(sign="-", source="old_rows")
        ),
    )
};
    END IF;
    RETURN NULL;
END $$;

-- forget_totals(table): empty a totals table; forget_totals('row_counts', counter): one counter's rows.
CREATE FUNCTION forget_totals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_NARGS = 1 THEN
        EXECUTE format('DELETE FROM %I', TG_ARGV[0]);
    ELSE
        DELETE FROM row_counts WHERE counter = TG_ARGV[1];
    END IF;
    RETURN NULL;
END $$;
"""

_TRIGGERS = """
CREATE TRIGGER llm_calls_totals AFTER INSERT ON llm_calls
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_llm_calls();
CREATE TRIGGER llm_calls_truncated AFTER TRUNCATE ON llm_calls
    FOR EACH STATEMENT EXECUTE FUNCTION forget_totals('llm_call_totals');
CREATE TRIGGER extraction_audit_totals AFTER INSERT ON extraction_audit
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_segments();
CREATE TRIGGER extraction_audit_truncated AFTER TRUNCATE ON extraction_audit
    FOR EACH STATEMENT EXECUTE FUNCTION forget_totals('row_counts', 'segments');
CREATE TRIGGER facts_inserted_totals AFTER INSERT ON facts
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_facts();
CREATE TRIGGER facts_updated_totals AFTER UPDATE ON facts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_facts();
CREATE TRIGGER facts_deleted_totals AFTER DELETE ON facts
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION count_facts();
CREATE TRIGGER facts_truncated AFTER TRUNCATE ON facts
    FOR EACH STATEMENT EXECUTE FUNCTION forget_totals('row_counts', 'facts');
CREATE TRIGGER jobs_inserted_totals AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_jobs();
CREATE TRIGGER jobs_updated_totals AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_jobs();
CREATE TRIGGER jobs_deleted_totals AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION count_jobs();
CREATE TRIGGER jobs_truncated AFTER TRUNCATE ON jobs
    FOR EACH STATEMENT EXECUTE FUNCTION forget_totals('job_totals');
"""


def upgrade() -> None:
    op.create_table(
        "row_counts",
        sa.Column("counter", sa.Text(), nullable=False),
        sa.Column("label", sa.Text(), nullable=False),
        sa.Column("backend", sa.Integer(), nullable=False),
        sa.Column("n", sa.BigInteger(), server_default="0", nullable=False),
        sa.CheckConstraint("counter IN ('facts', 'segments')", name=op.f("ck_row_counts_counter")),
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
    op.execute("LOCK TABLE jobs, llm_calls, extraction_audit, facts IN SHARE MODE")
    op.execute(_FUNCTIONS)
    op.execute(_TRIGGERS)
    op.execute(_LLM_TOTALS.format(source="llm_calls", backend="0"))
    op.execute(_JOB_TOTALS.format(backend="0", rows=_JOBS.format(sign="", source="jobs")))
    op.execute(
        _ROW_COUNTS.format(counter="segments", backend="0", rows=_SEGMENTS.format(source="extraction_audit"))
    )
    op.execute(_ROW_COUNTS.format(counter="facts", backend="0", rows=_FACTS.format(sign="", source="facts")))


def downgrade() -> None:
    for trigger, table in (
        ("llm_calls_totals", "llm_calls"),
        ("llm_calls_truncated", "llm_calls"),
        ("extraction_audit_totals", "extraction_audit"),
        ("extraction_audit_truncated", "extraction_audit"),
        ("facts_inserted_totals", "facts"),
        ("facts_updated_totals", "facts"),
        ("facts_deleted_totals", "facts"),
        ("facts_truncated", "facts"),
        ("jobs_inserted_totals", "jobs"),
        ("jobs_updated_totals", "jobs"),
        ("jobs_deleted_totals", "jobs"),
        ("jobs_truncated", "jobs"),
    ):
        op.execute(f"DROP TRIGGER {trigger} ON {table}")
    for function in ("count_llm_calls", "count_segments", "count_facts", "count_jobs", "forget_totals"):
        op.execute(f"DROP FUNCTION {function}()")
    op.drop_index("ix_op_checkpoints_skipped", table_name="op_checkpoints")
    op.drop_table("job_totals")
    op.drop_table("llm_call_totals")
    op.drop_table("row_counts")
