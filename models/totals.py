"""Running totals of the growing tables, kept by triggers as their rows are written (migration 0016).

/metrics reads these few rows instead of aggregating the source tables at every scrape. Each writing
Postgres backend adds to rows of its own (``backend`` is its pid), so concurrent commits never wait on
one counter row; ``fold_totals`` moves the rows of backends that have gone into backend 0, so the tables
stay as small as the number of live connections.
"""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import ARRAY, BigInteger, CheckConstraint, Numeric, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base

# The counters of row_counts (labels: what each is counted by): facts by status (audit rows excluded),
# extraction_audit rows by outcome, consolidation decisions by "decision/decided_by", compactions by
# status, the context tokens accepted compactions saved (label ""), backfill requests by status.
FACTS_COUNTER = "facts"
SEGMENTS_COUNTER = "segments"
DECISIONS_COUNTER = "decisions"
COMPACTIONS_COUNTER = "compactions"
TOKENS_SAVED_COUNTER = "compaction_tokens_saved"
BACKFILL_REQUESTS_COUNTER = "backfill_requests"
COUNTERS = (
    FACTS_COUNTER,
    SEGMENTS_COUNTER,
    DECISIONS_COUNTER,
    COMPACTIONS_COUNTER,
    TOKENS_SAVED_COUNTER,
    BACKFILL_REQUESTS_COUNTER,
)


def _total_column() -> Mapped[int]:
    return mapped_column(BigInteger, nullable=False, server_default="0")


class RowCount(Base):
    """Rows of a source table by one label (facts by status, segments by outcome, ...), per backend."""

    __tablename__ = "row_counts"
    __table_args__ = (
        CheckConstraint("counter IN ({})".format(", ".join(f"'{c}'" for c in COUNTERS)), name="counter"),
    )

    counter: Mapped[str] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(primary_key=True)
    backend: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int] = _total_column()  # a backend's share may be negative (it deleted others' rows)


class JobTotal(Base):
    """Jobs by status and kind, with the attempts and worker losses they spent, per backend."""

    __tablename__ = "job_totals"

    status: Mapped[str] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(primary_key=True)
    backend: Mapped[int] = mapped_column(primary_key=True)
    jobs: Mapped[int] = _total_column()
    attempts: Mapped[int] = _total_column()
    worker_losses: Mapped[int] = _total_column()


class LLMCallTotal(Base):
    """llm_calls rows by purpose and outcome, per backend: counts, token, cost and latency sums, and
    ``latency_le[i]``, the calls no slower than worker.api.metrics.LLM_LATENCY_BUCKETS_MS[i]."""

    __tablename__ = "llm_call_totals"

    purpose: Mapped[str] = mapped_column(primary_key=True)
    outcome: Mapped[str] = mapped_column(primary_key=True)
    backend: Mapped[int] = mapped_column(primary_key=True)
    calls: Mapped[int] = _total_column()
    input_tokens: Mapped[int] = _total_column()
    output_tokens: Mapped[int] = _total_column()
    cache_read_tokens: Mapped[int] = _total_column()
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(18, 6), nullable=False, server_default="0")
    latency_ms: Mapped[int] = _total_column()
    latency_le: Mapped[list[int]] = mapped_column(ARRAY(BigInteger), nullable=False)


# Rows of backends no longer connected, moved into backend 0 (a pid reused meanwhile only waits on the
# row lock and then starts a row of its own). One statement per table, so each moves all or nothing.
_GONE = "backend <> 0 AND backend NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
_FOLDS = (
    text(
        f"""
        WITH gone AS (DELETE FROM row_counts WHERE {_GONE} RETURNING counter, label, n)
        INSERT INTO row_counts AS r (counter, label, backend, n)
        SELECT counter, label, 0, sum(n) FROM gone GROUP BY counter, label ORDER BY counter, label
        ON CONFLICT (counter, label, backend) DO UPDATE SET n = r.n + EXCLUDED.n
        """
    ),
    text(
        f"""
        WITH gone AS (
            DELETE FROM job_totals WHERE {_GONE} RETURNING status, kind, jobs, attempts, worker_losses
        )
        INSERT INTO job_totals AS t (status, kind, backend, jobs, attempts, worker_losses)
        SELECT status, kind, 0, sum(jobs), sum(attempts), sum(worker_losses) FROM gone
        GROUP BY status, kind ORDER BY status, kind
        ON CONFLICT (status, kind, backend) DO UPDATE SET
            jobs = t.jobs + EXCLUDED.jobs,
            attempts = t.attempts + EXCLUDED.attempts,
            worker_losses = t.worker_losses + EXCLUDED.worker_losses
        """
    ),
    text(
        f"""
        WITH gone AS (DELETE FROM llm_call_totals WHERE {_GONE} RETURNING *),
        summed AS (
            SELECT purpose, outcome, sum(calls) AS calls, sum(input_tokens) AS input_tokens,
                   sum(output_tokens) AS output_tokens, sum(cache_read_tokens) AS cache_read_tokens,
                   sum(cost_usd) AS cost_usd, sum(latency_ms) AS latency_ms,
                   ARRAY(SELECT sum(le) FROM gone g2, unnest(g2.latency_le) WITH ORDINALITY AS u(le, i)
                         WHERE g2.purpose = g.purpose AND g2.outcome = g.outcome GROUP BY i ORDER BY i)
                       AS latency_le
            FROM gone g GROUP BY purpose, outcome
        )
        INSERT INTO llm_call_totals AS t (purpose, outcome, backend, calls, input_tokens, output_tokens,
                                          cache_read_tokens, cost_usd, latency_ms, latency_le)
        SELECT purpose, outcome, 0, calls, input_tokens, output_tokens, cache_read_tokens, cost_usd,
               latency_ms, latency_le
        FROM summed ORDER BY purpose, outcome
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
    ),
    text(
        f"""
        WITH gone AS (DELETE FROM llm_spend_days WHERE {_GONE} RETURNING day, scope, cost_usd)
        INSERT INTO llm_spend_days AS d (day, scope, backend, cost_usd)
        SELECT day, scope, 0, sum(cost_usd) FROM gone GROUP BY day, scope ORDER BY day, scope
        ON CONFLICT (day, scope, backend) DO UPDATE SET cost_usd = d.cost_usd + EXCLUDED.cost_usd
        """
    ),
)


def fold_totals(session: Session) -> int:
    """Fold the per-backend rows of gone backends (the totals tables and llm_spend_days) into
    backend 0, in the caller's transaction; returns how many backend-0 rows it wrote."""
    return sum(session.execute(fold).rowcount for fold in _FOLDS)  # type: ignore[attr-defined]
