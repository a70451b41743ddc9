"""Running totals of the growing tables, kept by triggers as their rows are written (migration 0016).

/metrics reads these few rows instead of aggregating the source tables at every scrape. Each writing
Postgres backend adds to rows of its own (``backend`` is its pid), so concurrent commits never wait on
one counter row; ``fold_totals`` moves the rows of backends that have gone into backend 0, so the tables
stay as small as the number of live connections.
"""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import ARRAY, BigInteger, CheckConstraint, Numeric, TextClause, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base

# The counters of row_counts (labels: what each is counted by): facts by status (audit rows excluded),
# extraction_audit rows by outcome, consolidation decisions by "decision/decided_by", compactions by
# status, the context tokens accepted compactions saved (label ""), backfill requests by status, what
# backfill jobs' LLM calls cost, jobs that ended by "status/kind".
FACTS_COUNTER = "facts"
SEGMENTS_COUNTER = "segments"
DECISIONS_COUNTER = "decisions"
COMPACTIONS_COUNTER = "compactions"
TOKENS_SAVED_COUNTER = "compaction_tokens_saved"
BACKFILL_REQUESTS_COUNTER = "backfill_requests"
BACKFILL_COST_COUNTER = "backfill_cost_micro_usd"  # micro-dollars (cost_usd has six places), label ""
# Jobs that ended, by "status/kind" (succeeded or failed; cancelled, migration 0041: failed because its
# subject was erased), counted as each ends (migration 0024): a counter, so a retry of a failed job or a
# job deleted past its retention takes nothing away.
JOBS_ENDED_COUNTER = "jobs_ended"
COUNTERS = (
    FACTS_COUNTER,
    SEGMENTS_COUNTER,
    DECISIONS_COUNTER,
    COMPACTIONS_COUNTER,
    TOKENS_SAVED_COUNTER,
    BACKFILL_REQUESTS_COUNTER,
    BACKFILL_COST_COUNTER,
    JOBS_ENDED_COUNTER,
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


def _fold(table: str, keys: tuple[str, ...], sums: tuple[str, ...], array: str | None = None) -> TextClause:
    """The fold of one totals table: its ``keys`` (beside ``backend``), the columns summed, and at most
    one array column summed element by element."""
    key_list = ", ".join(keys)
    summed = [f"sum({c}) AS {c}" for c in sums]
    added = [f"{c} = t.{c} + EXCLUDED.{c}" for c in sums]
    if array is not None:
        match = " AND ".join(f"g2.{k} = g.{k}" for k in keys)
        summed.append(
            f"ARRAY(SELECT sum(v) FROM gone g2, unnest(g2.{array}) WITH ORDINALITY AS u(v, i) "
            f"WHERE {match} GROUP BY i ORDER BY i) AS {array}"
        )
        added.append(
            f"{array} = ARRAY(SELECT a + b FROM unnest(t.{array}, EXCLUDED.{array}) "
            "WITH ORDINALITY AS u(a, b, i) ORDER BY i)"
        )
    values = ", ".join((*sums, *([array] if array else [])))
    return text(
        f"WITH gone AS (DELETE FROM {table} WHERE {_GONE} RETURNING *), "
        f"summed AS (SELECT {key_list}, {', '.join(summed)} FROM gone g GROUP BY {key_list}) "
        f"INSERT INTO {table} AS t ({key_list}, backend, {values}) "
        f"SELECT {key_list}, 0, {values} FROM summed ORDER BY {key_list} "
        f"ON CONFLICT ({key_list}, backend) DO UPDATE SET {', '.join(added)}"
    )


_FOLDS = (
    _fold("row_counts", ("counter", "label"), ("n",)),
    _fold("job_totals", ("status", "kind"), ("jobs", "attempts", "worker_losses")),
    _fold(
        "llm_call_totals",
        ("purpose", "outcome"),
        ("calls", "input_tokens", "output_tokens", "cache_read_tokens", "cost_usd", "latency_ms"),
        array="latency_le",
    ),
    _fold("llm_spend_days", ("day", "scope"), ("cost_usd",)),
)


def fold_totals(session: Session) -> int:
    """Fold the per-backend rows of gone backends (the totals tables and llm_spend_days) into
    backend 0, in the caller's transaction; returns how many backend-0 rows it wrote."""
    return sum(session.execute(fold).rowcount for fold in _FOLDS)  # type: ignore[attr-defined]
