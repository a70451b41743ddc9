"""Running totals (migration 0016): triggers keep facts by status, segment attempts by outcome and LLM
calls by purpose and outcome in the writing transaction; /metrics reads them; the sweep folds the rows
of gone connections into backend 0 without changing a total."""

from __future__ import annotations

import threading
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, pool, text
from sqlalchemy.orm import Session, sessionmaker

from models import fold_totals
from tests.service import wait_for
from worker import db
from worker.accounting import PRICES_KEY, Ledger, LLMCallRecord
from worker.api.metrics import (
    LLM_LATENCY_BUCKETS_MS,
    BackfillCollector,
    ConsolidationCollector,
    PostgresCollector,
    StoreCollector,
)
from worker.api.scrape_reads import MissingReadsCollector
from worker.llm.types import Usage

pytestmark = pytest.mark.integration

LEDGER = Ledger(lambda key: '{"m": {"input": 10000, "output": 0}}' if key == PRICES_KEY else None)

FACTS_NOW = text("SELECT status, count(*) FROM facts WHERE NOT is_audit GROUP BY status")
FACTS_KEPT = text(
    "SELECT label, sum(n) FROM row_counts WHERE counter = 'facts' GROUP BY label HAVING sum(n) <> 0"
)
SEGMENTS_NOW = text("SELECT outcome, count(*) FROM extraction_audit GROUP BY outcome")
SEGMENTS_KEPT = text("SELECT label, sum(n) FROM row_counts WHERE counter = 'segments' GROUP BY label")
CALLS_NOW = text(
    "SELECT purpose, outcome, count(*), sum(input_tokens), sum(output_tokens), sum(cache_read_tokens), "
    "sum(cost_usd), sum(latency_ms) FROM llm_calls GROUP BY purpose, outcome"
)
CALLS_KEPT = text(
    "SELECT purpose, outcome, sum(calls), sum(input_tokens), sum(output_tokens), sum(cache_read_tokens), "
    "sum(cost_usd), sum(latency_ms) FROM llm_call_totals GROUP BY purpose, outcome"
)


def add_facts(session: Session | Connection, page: str, statuses: list[str], audit: bool = False) -> None:
    session.execute(
        text(
            "INSERT INTO facts (source_id, fact, kind, confidence, notability, source, source_session, "
            "source_markdown_slug, row_num, is_audit, status) "
            "SELECT 'default', 'fact ' || n, 'event', 0.9, 'medium', 's', 's', :page, "
            "CASE WHEN :audit THEN -n::int ELSE n::int END, :audit, status "
            "FROM unnest(CAST(:statuses AS text[])) WITH ORDINALITY AS u(status, n)"
        ),
        {"page": page, "statuses": statuses, "audit": audit},
    )


def add_attempts(session: Session | Connection, outcomes: list[str]) -> None:
    session.execute(
        text(
            "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, segment_end, "
            "outcome) SELECT 'default', 'p', n::int, 'a', 'b', outcome "
            "FROM unnest(CAST(:outcomes AS text[])) WITH ORDINALITY AS u(outcome, n)"
        ),
        {"outcomes": outcomes},
    )


def call(purpose: str, outcome: str, tokens: int, latency_ms: int) -> LLMCallRecord:
    usage = Usage(input_tokens=tokens, output_tokens=tokens // 2, cache_read_tokens=tokens // 4)
    return LLMCallRecord(purpose, "p", "m", usage, latency_ms=latency_ms, outcome=outcome)


JOBS_NOW = text(
    "SELECT status, kind, count(*), sum(attempts), sum(worker_losses) FROM jobs GROUP BY status, kind"
)
JOBS_KEPT = text(
    "SELECT status, kind, sum(jobs), sum(attempts), sum(worker_losses) FROM job_totals "
    "GROUP BY status, kind HAVING sum(jobs) <> 0"
)


def scrape(collectors: list[StoreCollector | ConsolidationCollector]) -> list[tuple[str, list[Any]]]:
    """What /metrics would print of these collectors' families, comparable."""
    return [
        (m.name, sorted((s.name, sorted(s.labels.items()), s.value) for s in m.samples))
        for c in collectors
        for m in c.collect()
    ]


def assert_totals_match(session: Session) -> None:
    assert sorted(session.execute(JOBS_KEPT).all()) == sorted(session.execute(JOBS_NOW).all())
    assert dict(session.execute(FACTS_KEPT).all()) == dict(session.execute(FACTS_NOW).all())
    assert dict(session.execute(SEGMENTS_KEPT).all()) == dict(session.execute(SEGMENTS_NOW).all())
    assert sorted(session.execute(CALLS_KEPT).all()) == sorted(session.execute(CALLS_NOW).all())


def test_totals_follow_inserts_updates_deletes_and_rollbacks(tx_factory: sessionmaker[Session]) -> None:
    with tx_factory.begin() as session:
        add_facts(session, "a", ["current", "current", "superseded"])
        add_facts(session, "a", ["current"], audit=True)  # audit rows are not facts
        add_attempts(session, ["ok", "ok", "malformed_output"])
        LEDGER.record_many(session, [call("extraction", "ok", 100, 40), call("extraction", "ok", 60, 900)])
        LEDGER.record(session, call("consolidation", "provider_error", 0, 30_000))
    with tx_factory.begin() as session:
        session.execute(text("UPDATE facts SET status = 'duplicate' WHERE fact = 'fact 1' AND NOT is_audit"))
        session.execute(text("UPDATE facts SET confidence = 0.5"))  # no status moves: nothing to count
        session.execute(
            text("UPDATE facts SET is_audit = true, row_num = -100 WHERE fact = 'fact 2'")
        )  # leaves the facts
        session.execute(text("DELETE FROM facts WHERE status = 'superseded'"))
    with pytest.raises(RuntimeError), tx_factory.begin() as session:
        add_facts(session, "b", ["current"] * 5)
        add_attempts(session, ["ok"])
        LEDGER.record(session, call("extraction", "ok", 10, 10))
        raise RuntimeError("the commit failed: its counts go with it")
    with tx_factory() as session:
        assert dict(session.execute(FACTS_KEPT).all()) == {"duplicate": 1}
        assert dict(session.execute(SEGMENTS_KEPT).all()) == {"ok": 2, "malformed_output": 1}
        assert sorted(session.execute(CALLS_KEPT).all()) == [
            ("consolidation", "provider_error", 1, 0, 0, 0, Decimal("0.000000"), 30_000),
            ("extraction", "ok", 2, 160, 80, 40, Decimal("1.240000"), 940),
        ]
        assert_totals_match(session)


def test_job_totals_follow_each_jobs_status_and_spent_budgets(database_url: str) -> None:
    """Jobs by status and kind with their attempts and worker losses; a heartbeat (an UPDATE that moves
    none of them) writes no total, so the workers' most frequent write costs no counter row."""
    engine = db.get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs CASCADE"))
        conn.execute(
            text(
                "INSERT INTO jobs (kind, subject, status) VALUES ('extraction', 'a', 'queued'), "
                "('extraction', 'b', 'queued'), ('compaction', 'c', 'queued')"
            )
        )
        conn.execute(text("UPDATE jobs SET status = 'running', attempts = 1 WHERE subject IN ('a', 'c')"))
        conn.execute(text("UPDATE jobs SET status = 'running', worker_losses = 1 WHERE subject = 'b'"))
        conn.execute(text("UPDATE jobs SET status = 'succeeded' WHERE subject = 'a'"))
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '2s'"))
        versions = text("SELECT ctid::text, * FROM job_totals ORDER BY ctid")  # a rewrite moves the ctid
        before = conn.execute(versions).all()
        conn.execute(text("UPDATE jobs SET heartbeat_at = now() WHERE status = 'running'"))
        assert conn.execute(versions).all() == before
        conn.execute(text("DELETE FROM jobs WHERE subject = 'c'"))
    with Session(engine) as session:
        assert sorted(session.execute(JOBS_KEPT).all()) == [
            ("running", "extraction", 1, 0, 1),
            ("succeeded", "extraction", 1, 1, 0),
        ]
        assert_totals_match(session)


COUNTED = text("SELECT counter, label, sum(n) FROM row_counts GROUP BY 1, 2 HAVING sum(n) <> 0 ORDER BY 1, 2")
ENDED = text("SELECT label, sum(n) FROM row_counts WHERE counter = 'jobs_ended' GROUP BY 1 ORDER BY 1")


def test_jobs_that_end_are_counted_and_nothing_takes_the_count_back(
    tx_factory: sessionmaker[Session],
) -> None:
    """factmill_jobs_ended_total: the failing-jobs alert took increase() of the failed gauge, which read
    a retry (failed -> queued) or a retention delete as a counter reset and fired."""
    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (kind, subject, status) VALUES ('extraction', 'a', 'queued'), "
                "('extraction', 'b', 'queued'), ('compaction', 'c', 'queued')"
            )
        )
        session.execute(text("UPDATE jobs SET status = 'running'"))
        session.execute(text("UPDATE jobs SET heartbeat_at = now()"))  # no status moves: nothing counted
        session.execute(text("UPDATE jobs SET status = 'failed' WHERE subject IN ('a', 'c')"))
        session.execute(text("UPDATE jobs SET status = 'succeeded' WHERE subject = 'b'"))
        session.execute(text("UPDATE jobs SET status = 'failed' WHERE subject = 'a'"))  # already failed
        assert session.execute(ENDED).all() == [
            ("failed/compaction", 1), ("failed/extraction", 1), ("succeeded/extraction", 1),
        ]  # fmt: skip
        session.execute(text("UPDATE jobs SET status = 'queued' WHERE subject = 'a'"))  # a retry
        session.execute(text("DELETE FROM jobs WHERE subject IN ('b', 'c')"))  # past the retention
        assert session.execute(ENDED).all() == [
            ("failed/compaction", 1), ("failed/extraction", 1), ("succeeded/extraction", 1),
        ]  # fmt: skip
        session.execute(text("UPDATE jobs SET status = 'failed' WHERE subject = 'a'"))  # fails again
        assert dict(session.execute(ENDED).all())["failed/extraction"] == 2
    samples = dict(scrape([StoreCollector(tx_factory)]))["factmill_jobs_ended"]
    ended = {(dict(labels)["status"], dict(labels)["kind"]): value for _, labels, value in samples}
    assert ended[("failed", "extraction")] == 2 and ended[("succeeded", "extraction")] == 1
    assert ended[("succeeded", "consolidation")] == 0  # every kind's series, from its first scrape


def test_jobs_cancelled_by_an_erasure_are_counted_apart_from_failures(
    tx_factory: sessionmaker[Session],
) -> None:
    """Erasing a page or a transcript fails its pending jobs: counted as failed, a routine erasure fired
    FactmillJobsFailing (it watches status="failed")."""
    from worker.jobs.outbox import cancel_jobs

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (kind, subject, status) VALUES ('extraction', 'gone', 'running'), "
                "('compaction', 'gone', 'paused'), ('extraction', 'kept', 'queued')"
            )
        )
        assert cancel_jobs(session, "extraction", "gone", "page erased") == 1
        assert cancel_jobs(session, "compaction", "gone", "transcript erased") == 1
        # The naming ends with the update: a job that fails after it, in the same transaction, is a failure.
        session.execute(text("UPDATE jobs SET status = 'failed' WHERE subject = 'kept'"))
        assert session.execute(ENDED).all() == [
            ("cancelled/compaction", 1), ("cancelled/extraction", 1), ("failed/extraction", 1),
        ]  # fmt: skip
    samples = dict(scrape([StoreCollector(tx_factory)]))["factmill_jobs_ended"]
    ended = {(dict(labels)["status"], dict(labels)["kind"]): value for _, labels, value in samples}
    assert ended[("cancelled", "extraction")] == 1 and ended[("failed", "extraction")] == 1
    assert ended[("cancelled", "compaction")] == 1 and ended[("failed", "compaction")] == 0


def test_compactions_and_decisions_are_counted_through_updates_and_cascades(
    tx_factory: sessionmaker[Session],
) -> None:
    """Compactions by status and the tokens accepted ones saved move with updates and with the cascade
    of a transcript's deletion; decisions are counted as they are made, by decision and decider."""
    with tx_factory.begin() as session:
        session.execute(text("INSERT INTO transcripts (id) VALUES ('t1'), ('t2')"))
        session.execute(
            text(
                "INSERT INTO compactions (transcript_id, status, cut_seq, tokens_before, tokens_after, "
                "summary) VALUES ('t1', 'accepted', 1, 1000, 100, 's'), "
                "('t1', 'rejected', 2, 500, NULL, NULL), ('t2', 'accepted', 1, 300, 50, 's')"
            )
        )
        session.execute(
            text(
                "INSERT INTO consolidation_decisions (source_id, entity_key, decision, decided_by, reason) "
                "VALUES ('d', 'e', 'duplicate', 'rule', 'r'), ('d', 'e', 'duplicate', 'rule', 'r'), "
                "('d', 'e', 'updates', 'model', 'r')"
            )
        )
    with tx_factory.begin() as session:
        session.execute(
            text(
                "UPDATE compactions SET status = 'accepted', tokens_after = 400, summary = 's' "
                "WHERE cut_seq = 2"
            )
        )
        session.execute(text("DELETE FROM transcripts WHERE id = 't2'"))  # cascades to its compaction
        assert session.execute(COUNTED).all() == [
            ("compaction_tokens_saved", "", 1000),
            ("compactions", "accepted", 2),
            ("decisions", "duplicate/rule", 2),
            ("decisions", "updates/model", 1),
        ]


def test_backfill_spend_counts_only_the_calls_of_backfill_jobs(tx_factory: sessionmaker[Session]) -> None:
    """factmill_backfill_cost_usd_total: the calls of jobs a backfill runs, exactly (micro-dollars),
    as the sum over those calls' rows said; other jobs' calls and free calls add nothing."""
    with tx_factory.begin() as session:
        ids = session.scalars(
            text(
                "INSERT INTO jobs (kind, subject) VALUES ('batch_extraction', 'b'), ('extraction', 'e') "
                "RETURNING id"
            )
        ).all()
        session.execute(text("INSERT INTO backfills (source_id, job_id) VALUES ('d', :j)"), {"j": ids[0]})
        priced = Ledger(lambda key: '{"m": {"input": 1.5, "output": 0}}' if key == PRICES_KEY else None)
        for job_id, tokens in ((ids[0], 7), (ids[0], 1), (ids[1], 1000), (ids[0], 0)):
            record = LLMCallRecord("extraction", "p", "m", Usage(input_tokens=tokens), 5, "ok", job_id=job_id)
            priced.record(session, record)
        old = session.scalar(
            text(
                "SELECT sum(cost_usd) FROM llm_calls WHERE job_id IN (SELECT job_id FROM backfills "
                "WHERE job_id IS NOT NULL)"
            )
        )
    assert old == Decimal("0.000012")  # 8 tokens at $1.50 a million
    [cost] = [m for m in BackfillCollector(tx_factory).collect() if m.name == "factmill_backfill_cost_usd"]
    assert cost.samples[0].value == float(old)


def test_latency_buckets_are_the_histograms(tx_factory: sessionmaker[Session]) -> None:
    """The trigger's bucket bounds (written out in migration 0016) are LLM_LATENCY_BUCKETS_MS: a call at
    each bound and one a millisecond past it land where /metrics says they do."""
    latencies = [ms + extra for ms in LLM_LATENCY_BUCKETS_MS for extra in (0, 1)] + [0]
    with tx_factory.begin() as session:
        LEDGER.record_many(session, [call("extraction", "ok", 1, ms) for ms in latencies])
        (kept,) = session.execute(text("SELECT latency_le FROM llm_call_totals")).one()
    assert kept == [sum(1 for ms in latencies if ms <= bound) for bound in LLM_LATENCY_BUCKETS_MS]


def test_truncating_a_table_empties_its_totals(tx_factory: sessionmaker[Session]) -> None:
    with tx_factory.begin() as session:
        add_facts(session, "a", ["current"])
        add_attempts(session, ["ok"])
        LEDGER.record(session, call("extraction", "ok", 1, 1))
        session.execute(text("TRUNCATE facts, extraction_audit, llm_calls CASCADE"))
        assert session.scalar(text("SELECT count(*) FROM row_counts")) == 0
        assert session.scalar(text("SELECT count(*) FROM llm_call_totals")) == 0


def test_each_connection_counts_on_rows_of_its_own_and_the_fold_keeps_every_total(database_url: str) -> None:
    """Two writers in open transactions never wait on each other's counter rows; once a connection has
    gone, fold_totals moves its rows into backend 0 and leaves a live connection's rows alone."""
    engine = db.get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE facts, extraction_audit, llm_calls, llm_spend_days CASCADE"))
    factory = sessionmaker(engine)
    first, second = engine.connect(), engine.connect()
    try:
        with first.begin():
            add_facts(first, "a", ["current", "current"])
            add_attempts(first, ["ok"])
            with second.begin():  # would wait (and fail at lock_timeout) on a shared counter row
                second.execute(text("SET LOCAL lock_timeout = '2s'"))
                add_facts(second, "b", ["current", "duplicate"])
                add_attempts(second, ["ok", "skipped"])
                with Session(second) as session:
                    LEDGER.record_many(session, [call("search_expansion", "ok", 20, 300)] * 3)
        gone = first.scalar(text("SELECT pg_backend_pid()"))
        live = second.scalar(text("SELECT pg_backend_pid()"))
    finally:
        first.invalidate()  # closes the DBAPI connection: its backend goes away
        first.close()
    scrapes: list[StoreCollector | ConsolidationCollector] = [
        StoreCollector(factory),
        ConsolidationCollector(factory),
    ]
    scraped = scrape(scrapes)
    with factory() as session:
        before: tuple[Counter[str], Counter[str], list[Any]] = (
            Counter(dict(session.execute(FACTS_KEPT).all())),
            Counter(dict(session.execute(SEGMENTS_KEPT).all())),
            sorted(session.execute(CALLS_KEPT).all()),
        )
        assert before[0] == {"current": 3, "duplicate": 1} and before[1] == {"ok": 2, "skipped": 1}
        backends = set(session.scalars(text("SELECT DISTINCT backend FROM row_counts")))
        assert backends == {gone, live}

    def backend_gone() -> bool:  # it leaves pg_stat_activity a moment after its socket closes
        with factory() as session:
            return not session.scalar(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": gone}
            )

    wait_for(backend_gone, 30, "the closed connection's backend to exit")
    with factory.begin() as session:
        assert fold_totals(session) > 0
    with factory() as session:
        assert set(session.scalars(text("SELECT DISTINCT backend FROM row_counts"))) == {0, live}
        assert set(session.scalars(text("SELECT DISTINCT backend FROM llm_call_totals"))) == {live}
        after: tuple[Counter[str], Counter[str], list[Any]] = (
            Counter(dict(session.execute(FACTS_KEPT).all())),
            Counter(dict(session.execute(SEGMENTS_KEPT).all())),
            sorted(session.execute(CALLS_KEPT).all()),
        )
        assert after == before
        assert_totals_match(session)
    assert scrape(scrapes) == scraped  # the scrape reads the same, and the latency buckets were summed
    second.close()


def test_totals_stay_exact_while_writers_come_and_go_and_the_sweep_folds(database_url: str) -> None:
    """Writers on short-lived connections (a new backend each transaction, so their rows soon belong to
    gone backends) insert, update and delete while another thread folds again and again: the fold's
    deletes meet the writers' upserts on the same rows, and no count is lost or doubled."""
    engine = db.get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE facts, extraction_audit, llm_calls, jobs, llm_spend_days CASCADE"))
    short_lived = create_engine(database_url, poolclass=pool.NullPool)
    folding, folds = threading.Event(), [0]
    errors: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for n in range(25):
                with Session(short_lived) as session, session.begin():
                    add_facts(session, f"w{worker}-{n}", ["current", "current", "superseded"])
                    add_attempts(session, ["ok", "malformed_output"] if n % 3 else ["ok"])
                    LEDGER.record(session, call("extraction", "ok", 10 + n, 40 * n))
                    session.execute(
                        text("INSERT INTO jobs (kind, subject) VALUES ('extraction', :s)"),
                        {"s": f"{worker}-{n}"},
                    )
                with Session(short_lived) as session, session.begin():
                    session.execute(
                        text(
                            "UPDATE facts SET status = 'duplicate' "
                            "WHERE source_markdown_slug = :p AND row_num = 1"
                        ),
                        {"p": f"w{worker}-{n - 1}"},
                    )
                    session.execute(
                        text("UPDATE jobs SET status = 'running', attempts = 1 WHERE subject = :s"),
                        {"s": f"{worker}-{n}"},
                    )
                    if n % 5 == 0:
                        session.execute(
                            text("DELETE FROM facts WHERE source_markdown_slug = :p"), {"p": f"w{worker}-{n}"}
                        )
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    def fold() -> None:
        try:
            while not folding.is_set():
                with Session(engine) as session, session.begin():
                    folds[0] += fold_totals(session)
        except BaseException as exc:
            errors.append(exc)

    folder = threading.Thread(target=fold)
    folder.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(6)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    folding.set()
    folder.join()
    short_lived.dispose()
    assert not errors, errors
    assert folds[0] > 0  # the fold did move gone backends' rows while the writers wrote
    with Session(engine) as session:
        assert_totals_match(session)
        assert session.scalar(text("SELECT sum(n) FROM row_counts WHERE counter = 'facts'")) == 6 * (
            25 * 3 - 5 * 3
        )


def test_a_scrape_reads_its_figures_in_one_snapshot(factory: sessionmaker[Session]) -> None:
    # The call totals and the latency buckets are two statements: a call committed between them made a
    # bucket count more calls than +Inf (and jobs and paused jobs disagreed the same way).
    from sqlalchemy import event

    engine = factory.kw["bind"]
    wrote: list[bool] = []

    def between(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "unnest(t.latency_le)" in statement and not wrote:
            wrote.append(True)
            with factory.begin() as other:  # another connection: the pool hands out a second one
                LEDGER.record_many(other, [call("extraction", "ok", 1, 50)])

    with factory.begin() as session:
        LEDGER.record_many(session, [call("extraction", "ok", 1, 50)])
    event.listen(engine, "before_cursor_execute", between)
    try:
        families = {m.name: m for m in StoreCollector(factory).collect()}
    finally:
        event.remove(engine, "before_cursor_execute", between)
    assert wrote
    samples = {
        s.labels["le"]: s.value for s in families["factmill_llm_latency_seconds"].samples if "le" in s.labels
    }
    assert samples["+Inf"] == 1 and max(samples.values()) == 1, samples


def test_figures_read_but_not_built_fail_no_scrape_and_say_the_store_is_up(
    factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built outside the read's error handling, one family that failed (stored latency buckets that no
    longer match the code's) failed the whole /metrics request: every series gone. It answers that the
    store is up (it was read), and the families' absence says the rest."""
    collector = StoreCollector(factory)

    def mismatched(rows: object) -> list[object]:
        raise ValueError("zip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(collector, "metrics", mismatched)
    families = {m.name: [s.value for s in m.samples] for m in collector.collect()}
    # Read: the store is up (an alert that it is down would lie), and the unbuilt figures are said.
    assert families == {"factmill_store_up": [1], "factmill_metrics_unbuilt": [1]}
    # Said once: not counted unread too (FactmillMetricsUnread fired beside FactmillMetricsUnbuilt).
    [unread] = MissingReadsCollector({"store": collector}).collect()
    assert [s.value for s in unread.samples] == [0]


def test_a_collector_whose_figures_could_not_be_read_is_said(
    factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the store's collector said it had failed: the others' families were simply absent, and the
    alerts on them (a page's text still held at a provider, Postgres's connections) went quiet unsaid."""
    backfills, postgres = BackfillCollector(factory), PostgresCollector(factory)
    missing = MissingReadsCollector({"backfills": backfills, "postgres": postgres})

    def timed_out(session: Session) -> object:
        raise RuntimeError("a query's own failure (not an outage: that is factmill_store_up's)")

    monkeypatch.setattr(backfills, "read", timed_out)
    assert backfills.collect() == [] and postgres.collect() != []
    (gauge,) = missing.collect()
    assert gauge.name == "factmill_metrics_unread"
    assert {s.labels["collector"]: s.value for s in gauge.samples} == {"backfills": 1, "postgres": 0}
    monkeypatch.undo()
    backfills.collect()
    assert {s.labels["collector"]: s.value for s in missing.collect()[0].samples} == {
        "backfills": 0,
        "postgres": 0,
    }
