"""Prometheus metrics: request counts and latency per route, and collectors that read Postgres at scrape
time (jobs, facts, segments, LLM calls, compactions, Postgres's connections)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import (
    BACKFILL_COST_COUNTER,
    BACKFILL_REQUESTS_COUNTER,
    BACKFILL_STATUSES,
    COMPACTION_STATUSES,
    COMPACTIONS_COUNTER,
    DECISIONS_COUNTER,
    FACTS_COUNTER,
    JOB_STATUSES,
    JOBS_ENDED_COUNTER,
    SEGMENT_OUTCOMES,
    SEGMENTS_COUNTER,
    TOKENS_SAVED_COUNTER,
    Backfill,
    BackfillBatch,
    ConfigEntry,
    Job,
    JobTotal,
    LLMCallTotal,
    OpCheckpoint,
    RowCount,
)
from models.backfill import BATCH_STATUSES, REQUEST_STATUSES, ProviderCopy
from worker.api.follow_up_metrics import FollowUpCollector
from worker.api.job_waits import JobWaits
from worker.api.request_metrics import install_request_metrics
from worker.api.scrape_reads import MissingReadsCollector, ScrapeTimeCollector
from worker.config_store import KILL_SWITCHES, is_enabled
from worker.core.consolidation import FACT_STATUSES
from worker.jobs.registry import KILL_SWITCH, kind_names, pause_reasons

logger = logging.getLogger(__name__)

# llm_calls.latency_ms buckets for the latency histogram, in milliseconds.
LLM_LATENCY_BUCKETS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000)
STORE_UP_HELP = "1 if the metrics query reached Postgres"
UNBUILT_HELP = "1 if the figures were read from Postgres but could not be built into metrics (see the log)"

_JOB_TOTALS = select(
    JobTotal.status,
    JobTotal.kind,
    func.sum(JobTotal.jobs),
    func.sum(JobTotal.attempts),
    func.sum(JobTotal.worker_losses),
).group_by(JobTotal.status, JobTotal.kind)
_COUNTS = (
    select(RowCount.label, func.sum(RowCount.n))
    .where(RowCount.counter == bindparam("b_counter"))
    .group_by(RowCount.label)
)


def _counts(session: Session, counter: str) -> dict[str, int]:
    """One counter of the running totals (models.totals), by label."""
    return {label: int(n) for label, n in session.execute(_COUNTS, {"b_counter": counter})}


# llm_call_totals by purpose and outcome, then each purpose's cumulative latency buckets.
_LLM_TOTALS = select(
    LLMCallTotal.purpose,
    LLMCallTotal.outcome,
    func.sum(LLMCallTotal.calls),
    func.sum(LLMCallTotal.input_tokens),
    func.sum(LLMCallTotal.output_tokens),
    func.sum(LLMCallTotal.cost_usd),
    func.sum(LLMCallTotal.cache_read_tokens),
    func.sum(LLMCallTotal.latency_ms),
).group_by(LLMCallTotal.purpose, LLMCallTotal.outcome)
_LATENCY_BUCKETS = text(
    "SELECT t.purpose, u.i, sum(u.le) "
    "FROM llm_call_totals t, unnest(t.latency_le) WITH ORDINALITY AS u(le, i) "
    "GROUP BY t.purpose, u.i ORDER BY t.purpose, u.i"
)


class _StoreRows:
    """What one scrape read: the running totals of jobs, facts, segments and LLM calls, and the rest."""

    def __init__(self, session: Session) -> None:
        job_rows = session.execute(_JOB_TOTALS).all()
        self.job_counts: dict[tuple[str, str], int] = {
            (status, kind): int(n) for status, kind, n, _, _ in job_rows
        }
        # The two budgets, summed over the jobs in each (status, kind).
        self.job_spent: dict[tuple[str, str], tuple[int, int]] = {
            (status, kind): (int(attempts), int(losses)) for status, kind, _, attempts, losses in job_rows
        }
        # Facts and segment attempts from the running totals the triggers keep (models.totals), not
        # from the tables: at a million rows each the aggregates took a second a scrape.
        self.jobs_ended = _counts(session, JOBS_ENDED_COUNTER)  # "status/kind" -> jobs ended so far
        self.facts = sum(_counts(session, FACTS_COUNTER).values())
        self.segment_rows = list(_counts(session, SEGMENTS_COUNTER).items())
        # Segments the checkpoints moved past without their facts, still waiting for `retry --skipped`.
        self.skipped_now = session.scalar(
            select(func.coalesce(func.sum(func.jsonb_array_length(OpCheckpoint.skipped)), 0)).where(
                OpCheckpoint.skipped != text("'[]'::jsonb")  # the partial index ix_op_checkpoints_skipped
            )
        )
        switch_rows = session.execute(
            select(ConfigEntry.key, ConfigEntry.value).where(ConfigEntry.key.in_(KILL_SWITCHES))
        ).all()
        self.switches: dict[str, str] = {key: value for key, value in switch_rows}
        # Paused jobs by why (ix_jobs_status_kind): a kill switch, the budget, a backfill's batches.
        self.paused: dict[tuple[str, str], int] = {
            (kind, reason or KILL_SWITCH): int(n)  # no reason: paused before reasons were recorded
            for kind, reason, n in session.execute(
                select(Job.kind, Job.pause_reason, func.count())
                .where(Job.status == "paused")
                .group_by(Job.kind, Job.pause_reason)
            )
        }
        self.waits = JobWaits.read(session)
        self.llm_rows = session.execute(_LLM_TOTALS).all()
        self.latency_buckets: dict[str, list[int]] = {}
        for purpose, _, n in session.execute(_LATENCY_BUCKETS):
            self.latency_buckets.setdefault(purpose, []).append(int(n))


def _paused_jobs(paused: dict[tuple[str, str], int], kinds: list[str]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(
        "factmill_jobs_paused",
        "Paused jobs by kind and reason: kill_switch (resumed when it is on), budget (when a budget has "
        "room), batch (a backfill waiting for its provider batches: normal, for up to 24 h), batch_fault "
        "(a backfill whose batches it cannot ask about or collect: its note says why)",
        labels=["kind", "reason"],
    )
    reasons = sorted(set(pause_reasons()) | {reason for _, reason in paused})
    for kind in sorted(set(kinds) | {kind for kind, _ in paused}):
        for reason in reasons:  # zeros included, so a series never vanishes when its last job resumes
            gauge.add_metric([kind, reason], paused.get((kind, reason), 0))
    return gauge


class StoreCollector(ScrapeTimeCollector[_StoreRows]):
    """Jobs by status and kind, facts, segment attempts by outcome, LLM calls, tokens, spend, latency."""

    says_unbuilt = True

    def read(self, session: Session) -> _StoreRows:
        return _StoreRows(session)

    def unreadable(self) -> list[Metric]:
        return [GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=0)]

    def unanswered(self) -> list[Metric]:
        """Reached, so the store is up: a statement past its timeout (a migration's lock held behind a long
        transaction) said "the API cannot read Postgres" (FactmillStoreDown, critical) while the other
        collectors read. factmill_metrics_unread{collector="store"} says it."""
        return [GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=1)]

    def unbuildable(self) -> list[Metric]:
        """Read, so the store is up (FactmillStoreDown would lie); the families that could not be built
        are absent, and factmill_metrics_unbuilt says so (FactmillMetricsUnbuilt), or their own alerts
        would go quiet unsaid."""
        return [
            GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=1),
            GaugeMetricFamily("factmill_metrics_unbuilt", UNBUILT_HELP, value=1),
        ]

    def metrics(self, rows: _StoreRows) -> list[Metric]:
        up = GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=1)
        jobs_gauge = GaugeMetricFamily("factmill_jobs", "Jobs by status and kind", labels=["status", "kind"])
        attempts = GaugeMetricFamily(
            "factmill_job_attempts",
            "Attempts spent by the jobs in each status and kind (runs that reached a verdict of their own)",
            labels=["status", "kind"],
        )
        losses = GaugeMetricFamily(
            "factmill_job_worker_losses",
            "Worker losses of the jobs in each status and kind (runs cut short by infrastructure)",
            labels=["status", "kind"],
        )
        kinds = sorted(set(kind_names()) | {kind for _, kind in rows.job_counts})
        for status in JOB_STATUSES:
            for kind in kinds:  # zeros included, so a series never vanishes when its last job moves on
                jobs_gauge.add_metric([status, kind], rows.job_counts.get((status, kind), 0))
                spent_attempts, spent_losses = rows.job_spent.get((status, kind), (0, 0))
                attempts.add_metric([status, kind], spent_attempts)
                losses.add_metric([status, kind], spent_losses)
        ended = CounterMetricFamily(
            "factmill_jobs_ended",
            "Jobs that ended, by status (succeeded, failed, cancelled: its page, transcript or entity "
            "erased) and kind, counted as each ends: a retry or a deletion past the retention takes nothing "
            "away (alert on its increase, not the gauge's)",
            labels=["status", "kind"],
        )
        ended_kinds = set(kinds) | {label.partition("/")[2] for label in rows.jobs_ended}
        for status in ("succeeded", "failed", "cancelled"):
            for kind in sorted(ended_kinds):  # zeros too: increase() misses a series' first sample
                ended.add_metric([status, kind], rows.jobs_ended.get(f"{status}/{kind}", 0))
        facts_gauge = GaugeMetricFamily(
            "factmill_facts", "Facts stored (audit rows excluded)", value=rows.facts or 0
        )
        segments = CounterMetricFamily(
            "factmill_segments",
            'Segment extraction attempts by outcome; outcome="skipped" counts poison segments skipped',
            labels=["outcome"],
        )
        seen = {outcome: n for outcome, n in rows.segment_rows}
        for outcome in sorted(set(SEGMENT_OUTCOMES) | set(seen)):
            segments.add_metric([outcome], seen.get(outcome, 0))
        skipped = GaugeMetricFamily(
            "factmill_segments_skipped",
            "Skipped (poison) segments whose facts are missing (`factmill jobs retry ID --skipped`)",
            value=int(rows.skipped_now or 0),
        )
        switches = GaugeMetricFamily(
            "factmill_kill_switch_enabled",
            "1 if the kill switch lets its work run, 0 if it is off",
            labels=["switch"],
        )
        for key in KILL_SWITCHES:
            switches.add_metric([key], 1 if is_enabled(rows.switches.get(key)) else 0)
        # 0 here, so the alert can take min over the API's replicas: one that builds them keeps the others
        # seeing (a healthy replica exported no series, and min over the broken one's alone fired).
        built = GaugeMetricFamily("factmill_metrics_unbuilt", UNBUILT_HELP, value=0)
        return [
            up,
            built,
            switches,
            jobs_gauge,
            _paused_jobs(rows.paused, kinds),
            *rows.waits.metrics(kind_names()),
            attempts,
            losses,
            ended,
            facts_gauge,
            segments,
            skipped,
            *_llm_metrics(rows),
            _latency(rows),
        ]


def _llm_metrics(rows: _StoreRows) -> list[Metric]:
    calls = CounterMetricFamily("factmill_llm_calls", "LLM calls by outcome", labels=["purpose", "outcome"])
    tokens = CounterMetricFamily(
        "factmill_llm_tokens",
        'LLM tokens by direction; direction="cached" counts the input tokens read from the prompt cache',
        labels=["purpose", "direction"],
    )
    cost = CounterMetricFamily("factmill_llm_cost_usd", "LLM spend in US dollars", labels=["purpose"])
    token_sums: dict[tuple[str, str], int] = {}
    cost_sums: dict[str, float] = {}
    for purpose, outcome, n, tokens_in, tokens_out, spend, cached, _ in rows.llm_rows:
        calls.add_metric([purpose, outcome], n)
        token_sums[(purpose, "cached")] = token_sums.get((purpose, "cached"), 0) + int(cached)
        token_sums[(purpose, "in")] = token_sums.get((purpose, "in"), 0) + int(tokens_in)
        token_sums[(purpose, "out")] = token_sums.get((purpose, "out"), 0) + int(tokens_out)
        cost_sums[purpose] = cost_sums.get(purpose, 0.0) + float(spend)
    for (purpose, direction), n in sorted(token_sums.items()):
        tokens.add_metric([purpose, direction], n)
    for purpose, dollars in sorted(cost_sums.items()):
        cost.add_metric([purpose], dollars)
    return [calls, tokens, cost]


def _latency(rows: _StoreRows) -> Metric:
    latency = HistogramMetricFamily(
        "factmill_llm_latency_seconds",
        "LLM call latency (llm_calls.latency_ms, from the running totals)",
        labels=["purpose"],
    )
    calls: dict[str, int] = {}
    total_ms: dict[str, int] = {}
    for purpose, _, n, _, _, _, _, ms in rows.llm_rows:
        calls[purpose] = calls.get(purpose, 0) + int(n)
        total_ms[purpose] = total_ms.get(purpose, 0) + int(ms)
    for purpose in sorted(calls):
        cumulative = rows.latency_buckets.get(purpose, [0] * len(LLM_LATENCY_BUCKETS_MS))
        buckets = [(str(ms / 1000), n) for ms, n in zip(LLM_LATENCY_BUCKETS_MS, cumulative, strict=True)]
        latency.add_metric(
            [purpose], [*buckets, ("+Inf", calls[purpose])], sum_value=total_ms[purpose] / 1000
        )
    return latency


class CompactionCollector(ScrapeTimeCollector[tuple[dict[str, int], int]]):
    """Prometheus collector over the compactions' running totals, read at scrape time (Postgres is the
    truth).

    ``factmill_compactions{outcome}``: compactions stored by outcome (accepted, rejected, failed);
    ``factmill_compaction_tokens_saved``: context tokens the accepted summaries stored took out
    (tokens before - tokens after, at the time of each compaction).
    Register it next to StoreCollector: ``registry.register(CompactionCollector(runtime.factory))``.
    """

    reads = "the compactions"

    def read(self, session: Session) -> tuple[dict[str, int], int]:
        return _counts(session, COMPACTIONS_COUNTER), sum(_counts(session, TOKENS_SAVED_COUNTER).values())

    def metrics(self, rows: tuple[dict[str, int], int]) -> list[Metric]:
        statuses, tokens_saved = rows
        # Gauges: the totals follow the rows, and an erased transcript takes its compactions with it;
        # as counters they fell, which Prometheus reads as a reset (increase() jumped by the total).
        outcomes = GaugeMetricFamily(
            "factmill_compactions",
            "Compactions stored, by outcome (an erasure takes some away)",
            labels=["outcome"],
        )
        for status in sorted(set(COMPACTION_STATUSES) | set(statuses)):
            outcomes.add_metric([status], statuses.get(status, 0))
        saved = GaugeMetricFamily(
            "factmill_compaction_tokens_saved",
            "Context tokens taken out by the accepted compactions stored (before - after)",
            value=tokens_saved,
        )
        return [outcomes, saved]


class ConsolidationCollector(ScrapeTimeCollector[tuple[dict[str, int], dict[str, int]]]):
    """The fact lifecycle, read at scrape time: ``factmill_consolidation_decisions_total{decision,
    decided_by}`` (the audit rows: duplicate, updates, contradicts, unrelated, new by rule or model;
    unmerge, restore by operators) and ``factmill_facts_by_status{status}``."""

    reads = "the consolidation decisions"

    def read(self, session: Session) -> tuple[dict[str, int], dict[str, int]]:
        return _counts(session, DECISIONS_COUNTER), _counts(session, FACTS_COUNTER)

    def metrics(self, rows: tuple[dict[str, int], dict[str, int]]) -> list[Metric]:
        decisions = CounterMetricFamily(
            "factmill_consolidation_decisions",
            "Consolidation decisions by type and by who decided (rule, model, operator)",
            labels=["decision", "decided_by"],
        )
        for label, n in sorted(rows[0].items()):  # labelled "decision/decided_by"
            decision, _, decided_by = label.partition("/")
            decisions.add_metric([decision, decided_by], n)
        statuses = GaugeMetricFamily(
            "factmill_facts_by_status", "Facts by lifecycle status (audit rows excluded)", labels=["status"]
        )
        for status in FACT_STATUSES:
            statuses.add_metric([status], rows[1].get(status, 0))
        return [decisions, statuses]


# A copy its run still holds (ProviderCopies.hold: it collects and deletes it) is not owed yet.
_OWED = select(func.count()).select_from(ProviderCopy).where(ProviderCopy.tried_at <= func.now())


class BackfillCollector(ScrapeTimeCollector[dict[str, list[tuple[str, float]]]]):
    """Backfills (batch_extraction jobs) at scrape time.

    ``factmill_backfills{status}``: backfills by status (planning, running, done, cancelled);
    ``factmill_backfill_requests{status}``: their batch requests by status (pending, done, failed,
    discarded, expired, cancelled, dropped); ``factmill_backfill_batches{status}``: their provider
    batches by status; ``factmill_backfill_cost_usd_total``: what their LLM calls cost (batch price);
    ``factmill_provider_copies_owed``: ended or abandoned provider batches whose files (page text) are
    still to be deleted at the provider (beat's backfill poll retries them; alert if it stays up).
    """

    reads = "the backfills"

    def read(self, session: Session) -> dict[str, list[tuple[str, float]]]:
        micro_usd = sum(_counts(session, BACKFILL_COST_COUNTER).values())
        return {
            "backfills": _by_status(session, Backfill.status),
            "requests": [
                (status, float(n)) for status, n in _counts(session, BACKFILL_REQUESTS_COUNTER).items()
            ],
            "batches": _by_status(session, BackfillBatch.status),
            "cost": [("", micro_usd / 1_000_000)],
            "owed": [("", float(session.scalar(_OWED) or 0))],
        }

    def metrics(self, rows: dict[str, list[tuple[str, float]]]) -> list[Metric]:
        families: list[Metric] = []
        for name, statuses, what in (
            ("backfills", BACKFILL_STATUSES, "Backfills by status"),
            ("requests", REQUEST_STATUSES, "Backfill batch requests by status"),
            ("batches", BATCH_STATUSES, "Backfill provider batches by status"),
        ):
            metric = "factmill_backfills" if name == "backfills" else f"factmill_backfill_{name}"
            gauge = GaugeMetricFamily(metric, what, labels=["status"])
            found = dict(rows[name])
            for status in sorted(set(statuses) | set(found)):
                gauge.add_metric([status], found.get(status, 0))
            families.append(gauge)
        families.append(
            CounterMetricFamily(
                "factmill_backfill_cost_usd", "USD spent by backfill LLM calls", value=rows["cost"][0][1]
            )
        )
        families.append(
            GaugeMetricFamily(
                "factmill_provider_copies_owed",
                "Provider batches whose files (page text) are still to be deleted at the provider",
                value=rows["owed"][0][1],
            )
        )
        return families


# Every backend connected to a database of the server (pg_stat_database needs no privilege, unlike the
# other sessions' rows of pg_stat_activity), and the connections ordinary roles may open: max_connections
# less the slots reserved for superusers (and, from Postgres 16, for pg_use_reserved_connections).
_CONNECTIONS = text(
    "SELECT (SELECT coalesce(sum(numbackends), 0) FROM pg_stat_database), "
    "current_setting('max_connections')::int "
    "- current_setting('superuser_reserved_connections')::int "
    "- coalesce(current_setting('reserved_connections', true), '0')::int"
)


class PostgresCollector(ScrapeTimeCollector[tuple[int, int]]):
    """The Postgres server's connections against its limit, at scrape time.

    ``factmill_postgres_connections``: backends connected now, from every process and client of the
    server; ``factmill_postgres_connection_limit``: how many ordinary roles may open. Each Factmill process
    keeps up to FACTMILL_DB_POOL_SIZE + FACTMILL_DB_MAX_OVERFLOW, so the alert on their ratio is the
    warning that one more worker, or a burst, will meet "too many clients".
    """

    reads = "the Postgres connections"

    def read(self, session: Session) -> tuple[int, int]:
        connections, limit = session.execute(_CONNECTIONS).one()
        return int(connections), int(limit)

    def metrics(self, rows: tuple[int, int]) -> list[Metric]:
        connections, limit = rows
        return [
            GaugeMetricFamily(
                "factmill_postgres_connections",
                "Backends connected to the Postgres server now (all databases, every client)",
                value=connections,
            ),
            GaugeMetricFamily(
                "factmill_postgres_connection_limit",
                "Connections ordinary roles may open: max_connections less the reserved slots",
                value=limit,
            ),
        ]


def _by_status(session: Session, column: Any) -> list[tuple[str, float]]:
    return [
        (status, float(n)) for status, n in session.execute(select(column, func.count()).group_by(column))
    ]


def install_metrics(
    app: FastAPI,
    factory: sessionmaker[Session],
    multiprocess_dir: Path | None,
    follow_ups: Sequence[str] = (),
) -> CollectorRegistry:
    """The app's own registry (so two apps in one process never share series), with the request
    metrics on ``app`` and the scrape-time collectors over ``factory``; ``follow_ups``: the steps after
    a commit whose lag is watched (``follow_up_steps``)."""
    registry = CollectorRegistry(auto_describe=False)
    install_request_metrics(app, registry, multiprocess_dir)
    # The store's own failures are said by factmill_store_up and factmill_metrics_unbuilt too.
    others: dict[str, ScrapeTimeCollector[Any]] = {
        "store": StoreCollector(factory),
        "compactions": CompactionCollector(factory),
        "consolidation": ConsolidationCollector(factory),
        "backfills": BackfillCollector(factory),
        "postgres": PostgresCollector(factory),
        "follow_ups": FollowUpCollector(factory, follow_ups),
    }
    for collector in others.values():
        registry.register(collector)  # type: ignore[arg-type]
    registry.register(MissingReadsCollector(others))  # type: ignore[arg-type]
    return registry


__all__ = [
    "BackfillCollector",
    "CompactionCollector",
    "ConsolidationCollector",
    "FollowUpCollector",
    "PostgresCollector",
    "StoreCollector",
    "install_metrics",
]
