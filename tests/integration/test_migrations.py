"""The migrations build exactly the schema the models describe (drift test), and downgrade cleanly."""

from __future__ import annotations

import re

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import CheckConstraint, create_engine, inspect, pool, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.schema import CreateIndex

import models
from tests.conftest import fresh_database
from worker import db

pytestmark = pytest.mark.integration


def test_migrations_match_models(server_url: str) -> None:
    with fresh_database(server_url, "drift") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            diff = compare_metadata(context, models.Base.metadata)
        engine.dispose()
    assert diff == [], f"models and migrations differ; write a migration: {diff}"


def test_generated_columns_match_models(server_url: str) -> None:
    """Alembic's comparison does not look inside a generated column's expression (it warns and passes):
    each Computed column of the models is built in a scratch table beside the migrated one, and
    Postgres's own rendering of the two expressions must agree."""
    computed = [
        (table, column)
        for table in models.Base.metadata.sorted_tables
        for column in table.columns
        if column.computed is not None
    ]
    assert computed, "no generated column found: the test would check nothing"
    with fresh_database(server_url, "generated") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        render = text(
            "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a "
            "ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
            "WHERE d.adrelid = CAST(:table AS regclass) AND a.attname = :column"
        )
        with engine.begin() as conn:
            for table, column in computed:
                conn.execute(text(f"CREATE TEMP TABLE scratch (LIKE {table.name})"))
                conn.execute(text(f"ALTER TABLE scratch DROP COLUMN {column.name}"))
                expression = str(column.computed.sqltext)  # type: ignore[union-attr]
                conn.execute(
                    text(
                        f"ALTER TABLE scratch ADD COLUMN {column.name} {column.type.compile(engine.dialect)} "
                        f"GENERATED ALWAYS AS ({expression}) STORED"
                    )
                )
                migrated = conn.scalar(render, {"table": table.name, "column": column.name})
                modelled = conn.scalar(render, {"table": "scratch", "column": column.name})
                assert migrated == modelled, f"{table.name}.{column.name}: write a migration"
                conn.execute(text("DROP TABLE scratch"))
        engine.dispose()


def test_downgrade_to_base_and_up_again(server_url: str) -> None:
    from alembic import command

    with fresh_database(server_url, "down") as url:
        db.upgrade(url)
        command.downgrade(db.alembic_config(url), "base")
        engine = create_engine(url, poolclass=pool.NullPool)
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        db.upgrade(url)
        assert set(models.Base.metadata.tables) <= set(inspect(engine).get_table_names())
        engine.dispose()


def test_two_upgrades_at_once_both_end_at_head(server_url: str) -> None:
    """Two upgrades at once (a repeated migrate step, the demo beside `db upgrade`) ran the same
    migrations; the second failed on a duplicate table and said "rolled back", exit 1, though the schema
    was at head. Now it waits for the first and finds nothing to do."""
    import subprocess
    import sys

    upgrade = "import sys; from worker import db; db.upgrade(sys.argv[1])"
    with fresh_database(server_url, "twice") as url:
        runs = [
            subprocess.Popen([sys.executable, "-c", upgrade, url], stderr=subprocess.PIPE) for _ in range(2)
        ]
        try:
            outcomes = [
                (run.wait(timeout=120), run.stderr.read().decode()[-2000:]) for run in runs if run.stderr
            ]
        finally:
            for run in runs:
                run.kill()
        assert [code for code, _ in outcomes] == [0, 0], outcomes
        assert db.current_revision(url) is not None and db.pending_revisions(url, "head") == []


def test_every_foreign_key_leads_an_index(database_url: str) -> None:
    """A delete of a referenced row looks for the rows pointing at it: with no index leading with the
    key's columns, that is a scan of the referencing table per row deleted (compactions.previous_id
    made a transcript's erasure scan every compaction once per compaction)."""
    inspector = inspect(db.get_engine(database_url))
    unindexed = []
    for table in inspector.get_table_names():
        leading = [tuple(index["column_names"]) for index in inspector.get_indexes(table)]
        leading += [tuple(u["column_names"]) for u in inspector.get_unique_constraints(table)]
        leading.append(tuple(inspector.get_pk_constraint(table)["constrained_columns"]))
        for key in inspector.get_foreign_keys(table):
            columns = tuple(key["constrained_columns"])
            if not any(index[: len(columns)] == columns for index in leading):
                unindexed.append(f"{table}{columns}")
    assert unindexed == [], f"foreign keys no index leads with: {unindexed}"


def test_each_migration_lets_its_locks_go_before_the_next_begins(server_url: str) -> None:
    """In one transaction, 0026's ALTER of llm_calls (which every segment commit writes) was held until
    the last migration committed: extraction and search waited out the whole upgrade."""
    with fresh_database(server_url, "locks") as url:
        db.upgrade(url, "0025")
        engine = create_engine(url, poolclass=pool.NullPool)
        written: list[str] = []

        def write_a_call(revision: str, seconds: float, doc: str) -> None:
            if revision != "0028":  # 0026 altered llm_calls two migrations before
                return
            with engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '500ms'"))
                conn.execute(
                    text(
                        "INSERT INTO llm_calls (provider, model, purpose, outcome, cost_usd) "
                        "VALUES ('p', 'm', 'extraction', 'ok', 0)"
                    )
                )
            written.append(revision)

        db.upgrade(url, on_step=write_a_call)
        engine.dispose()
        assert written == ["0028"], "the write ran between the migrations, not blocked by 0026's lock"
        assert db.pending_revisions(url) == [], "and the upgrade went on to the head"


def test_constraint_names_follow_the_convention(database_url: str) -> None:
    inspector = inspect(db.get_engine(database_url))
    assert inspector.get_pk_constraint("facts")["name"] == "pk_facts"
    uniques = {u["name"] for u in inspector.get_unique_constraints("facts")}
    assert "uq_facts_source_id_source_markdown_slug_row_num" in uniques


def test_0005_clears_compaction_ids_that_point_nowhere_then_adds_the_key(server_url: str) -> None:
    """Observations stored before the foreign key may name compactions that never existed or were
    deleted: 0005 sets those to NULL (keeping the observation) and keeps the ones that exist."""
    from alembic import command

    with fresh_database(server_url, "fk") as url:
        db.upgrade(url, "0004")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO transcripts (id) VALUES ('t')"))
            conn.execute(
                text(
                    "INSERT INTO compactions (id, transcript_id, status, cut_seq, tokens_before) "
                    "VALUES (7, 't', 'failed', 0, 0)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO calibration_observations (id, coverage, answer_kept, origin, compaction_id) "
                    "VALUES (1, 0.5, true, 'eval', 7), (2, 0.4, false, 'eval', 99), "
                    "(3, 0.3, true, 'eval', NULL)"
                )
            )
        db.upgrade(url)
        query = text("SELECT id, compaction_id FROM calibration_observations ORDER BY id")
        with engine.connect() as conn:
            assert conn.execute(query).all() == [(1, 7), (2, None), (3, None)]
        foreign_keys = inspect(engine).get_foreign_keys("calibration_observations")
        assert [(fk["name"], fk["referred_table"], fk["options"].get("ondelete")) for fk in foreign_keys] == [
            ("fk_calibration_observations_compaction_id_compactions", "compactions", "SET NULL")
        ]
        command.downgrade(db.alembic_config(url), "0004")
        assert inspect(engine).get_foreign_keys("calibration_observations") == []
        db.upgrade(url)
        with engine.connect() as conn:
            assert conn.execute(query).all() == [(1, 7), (2, None), (3, None)]
        engine.dispose()


def test_0015_fills_each_days_spend_from_the_calls_already_recorded(server_url: str) -> None:
    """A database upgraded on a busy day keeps its day budgets: 0015 sums the llm_calls rows so far
    into llm_spend_days, per UTC day and scope (free calls add nothing)."""
    with fresh_database(server_url, "spend") as url:
        db.upgrade(url, "0014")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO llm_calls (provider, model, purpose, outcome, cost_usd, created_at) VALUES "
                    "('p', 'm', 'extraction', 'ok', 1.25, '2026-11-30 23:59:59+00'), "
                    "('p', 'm', 'extraction', 'ok', 0.50, '2026-12-01 00:00:00+00'), "
                    "('p', 'm', 'consolidation', 'ok', 0.25, '2026-12-01 12:00:00+00'), "
                    "('p', 'm', 'search_expansion', 'ok', 0.10, '2026-12-01 13:00:00+00'), "
                    "('p', 'm', 'search_embedding', 'ok', 0.05, '2026-12-01 14:00:00+00'), "
                    "('p', 'm', 'extraction', 'provider_error', 0, '2026-12-01 15:00:00+00')"
                )
            )
        db.upgrade(url)
        query = text("SELECT day::text, scope, backend, cost_usd::text FROM llm_spend_days ORDER BY 1, 2")
        with engine.connect() as conn:
            assert conn.execute(query).all() == [
                ("2026-11-30", "work", 0, "1.250000"),
                ("2026-12-01", "search", 0, "0.150000"),
                ("2026-12-01", "work", 0, "0.750000"),
            ]
        engine.dispose()


def test_0016_counts_the_rows_already_there_into_the_running_totals(server_url: str) -> None:
    """A database upgraded with jobs, facts, segment attempts and LLM calls in it reports them: 0016
    counts them into its totals tables as backend 0, and its triggers count what comes after."""
    with fresh_database(server_url, "totals") as url:
        db.upgrade(url, "0015")
        engine = create_engine(url, poolclass=pool.NullPool)
        facts = (
            "INSERT INTO facts (source_id, fact, kind, confidence, notability, source, source_session, "
            "source_markdown_slug, row_num, is_audit, status) VALUES "
            "('default', 'a', 'event', 1, 'low', 's', 's', 'p', {n}, {audit}, '{status}')"
        )
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (kind, subject, status, attempts) VALUES "
                    "('extraction', 'a', 'succeeded', 2), ('extraction', 'b', 'succeeded', 1)"
                )
            )
            conn.execute(text("INSERT INTO transcripts (id) VALUES ('t')"))
            conn.execute(
                text(
                    "INSERT INTO compactions (transcript_id, status, cut_seq, tokens_before, tokens_after, "
                    "summary) VALUES ('t', 'accepted', 1, 1000, 100, 's'), ('t', 'failed', 2, 10, NULL, NULL)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO consolidation_decisions (source_id, entity_key, decision, decided_by, "
                    "reason) VALUES ('d', 'e', 'new', 'rule', 'r')"
                )
            )
            for n, (audit, status) in enumerate(
                [("false", "current"), ("false", "duplicate"), ("true", "current")]
            ):
                conn.execute(text(facts.format(n=-n if audit == "true" else n, audit=audit, status=status)))
            conn.execute(
                text(
                    "INSERT INTO extraction_audit (source_id, page_slug, segment_index, segment_start, "
                    "segment_end, outcome) VALUES ('d', 'p', 0, 'a', 'b', 'ok'), "
                    "('d', 'p', 1, 'a', 'b', 'ok')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO llm_calls (provider, model, purpose, outcome, input_tokens, cost_usd, "
                    "latency_ms) VALUES ('p', 'm', 'extraction', 'ok', 10, 0.5, 80), "
                    "('p', 'm', 'extraction', 'ok', 5, 0.25, 700)"
                )
            )
            # A backfill's job and its one call: 0016 counts what backfill jobs' calls cost.
            conn.execute(
                text("INSERT INTO backfills (source_id, job_id) SELECT 'd', id FROM jobs WHERE subject = 'a'")
            )
            conn.execute(
                text(
                    "INSERT INTO llm_calls (provider, model, purpose, outcome, cost_usd, batch, job_id) "
                    "SELECT 'p', 'm', 'extraction', 'ok', 0.125, true, id FROM jobs WHERE subject = 'a'"
                )
            )
        db.upgrade(url)
        with engine.begin() as conn:
            conn.execute(text(facts.format(n=7, audit="false", status="current")))
        with engine.connect() as conn:
            counts = conn.execute(
                text("SELECT counter, label, sum(n) FROM row_counts GROUP BY 1, 2 ORDER BY 1, 2")
            ).all()
            assert counts == [
                ("backfill_cost_micro_usd", "", 125_000),
                ("compaction_tokens_saved", "", 900),
                ("compactions", "accepted", 1),
                ("compactions", "failed", 1),
                ("decisions", "new/rule", 1),
                ("facts", "current", 2),
                ("facts", "duplicate", 1),
                ("jobs_ended", "succeeded/extraction", 2),  # 0024 counts the jobs that had ended
                ("segments", "ok", 2),
            ]
            assert conn.execute(
                text(
                    "SELECT purpose, calls, input_tokens, cost_usd::text, latency_le[1:4] "
                    "FROM llm_call_totals"
                )
            ).all() == [("extraction", 3, 15, "0.875000", [1, 2, 2, 2])]
            assert conn.execute(text("SELECT status, kind, jobs, attempts FROM job_totals")).all() == [
                ("succeeded", "extraction", 2, 3)
            ]
        engine.dispose()


def test_0020_keeps_the_digest_of_each_kept_delivery_key(server_url: str) -> None:
    """A delivery repeated across the upgrade is still replayed: 0020 turns each clear scoped key into
    the digest the service now looks up; no clear key is left."""
    from worker.deliveries import scoped_key

    with fresh_database(server_url, "digests") as url:
        db.upgrade(url, "0019")
        engine = create_engine(url, poolclass=pool.NullPool)
        clear = ["POST /v1/pages||alice-chat", "POST /v1/transcripts/{id}/messages|agent-1|k|é"]
        with engine.begin() as conn:
            for key in clear:
                conn.execute(
                    text(
                        "INSERT INTO webhook_deliveries (idempotency_key, body_hash, response) "
                        "VALUES (:key, 'h', '{}')"
                    ),
                    {"key": key},
                )
        db.upgrade(url)
        with engine.connect() as conn:
            stored = set(conn.scalars(text("SELECT idempotency_key FROM webhook_deliveries")))
        engine.dispose()
    assert stored == {
        scoped_key("POST /v1/pages", "", "alice-chat", "signature"),
        scoped_key("POST /v1/transcripts/{id}/messages", "agent-1", "k|é", "signature"),
    }


def test_0032_keeps_the_length_of_the_refusals_recorded_before_not_their_words(server_url: str) -> None:
    from worker.accounting import LLMCallRecord
    from worker.accounting.ledger import kept_error

    said = "I will not repeat Alice's diagnosis"
    with fresh_database(server_url, "refusals") as url:
        db.upgrade(url, "0031")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO llm_calls (provider, model, purpose, outcome, cost_usd, error) VALUES "
                    "('p', 'm', 'extraction', 'refusal', 0, :said), ('p', 'm', 'extraction', 'ok', 0, NULL), "
                    "('p', 'm', 'extraction', 'provider_error', 0, 'HTTP 500: boom')"
                ),
                {"said": said},
            )
        db.upgrade(url)
        with engine.connect() as conn:
            errors = conn.execute(text("SELECT error FROM llm_calls ORDER BY id")).scalars().all()
        engine.dispose()
    record = LLMCallRecord("extraction", "p", "m", None, 0, "refusal", error=said)
    assert errors == [kept_error(record), None, "HTTP 500: boom"]  # in the ledger's own words


def test_0041_counts_cancellations_apart_and_its_downgrade_adds_none_to_the_failures(server_url: str) -> None:
    from alembic import command

    ended = text("SELECT label, sum(n) FROM row_counts WHERE counter = 'jobs_ended' GROUP BY 1 ORDER BY 1")
    with fresh_database(server_url, "cancelled") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO jobs (kind, subject, status) VALUES ('extraction', 'a', 'queued')")
            )
            conn.execute(text("SELECT set_config('factmill.job_ending', 'cancelled', true)"))
            conn.execute(text("UPDATE jobs SET status = 'failed'"))
        with engine.connect() as conn:
            assert conn.execute(ended).all() == [("cancelled/extraction", 1)]
        command.downgrade(db.alembic_config(url), "0040")
        with engine.connect() as conn:
            # Folded into the failures, every past erasure fired FactmillJobsFailing at once.
            assert conn.execute(ended).all() == []
        db.upgrade(url)
        engine.dispose()


def test_0047_fills_the_running_totals_of_the_transcripts_already_there(server_url: str) -> None:
    from alembic import command

    with fresh_database(server_url, "totals") as url:
        command.upgrade(db.alembic_config(url), "0046")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO transcripts (id) VALUES ('t'), ('empty')"))
            conn.execute(
                text(
                    "INSERT INTO transcript_messages (transcript_id, seq, role, text, tokens) "
                    "SELECT 't', g, 'user', 'x', 10 + g FROM generate_series(0, 9) g"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO compactions (transcript_id, status, cut_seq, summary, tokens_before, "
                    "tokens_after) VALUES ('t', 'accepted', 4, 's', 145, 90), "
                    "('t', 'rejected', 6, 's', 1, 1), ('t', 'accepted', 10, 's', 145, 90)"
                )
            )
        db.upgrade(url)
        totals = text("SELECT id, message_count, message_tokens FROM transcripts ORDER BY id")
        cuts = text("SELECT status, tokens_cut FROM compactions ORDER BY id")
        with engine.connect() as conn:
            assert conn.execute(totals).all() == [("empty", 0, 0), ("t", 10, 145)]
            # (a cut past the last message stands for all of them; a rejected row is never applied)
            assert conn.execute(cuts).all() == [
                ("accepted", 10 + 11 + 12 + 13),
                ("rejected", 0),
                ("accepted", 145),
            ]
        # Kept by triggers: a writer that knows nothing of the columns (the release before, still
        # serving during a rolling upgrade) keeps them too.
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO transcript_messages (transcript_id, seq, role, text, tokens) VALUES "
                    "('t', 10, 'user', 'x', 100), ('t', 11, 'user', 'x', 1), ('empty', 0, 'user', 'x', 7)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO compactions (transcript_id, status, cut_seq, summary, tokens_before, "
                    "tokens_after) VALUES ('t', 'accepted', 11, 's', 246, 90), "
                    "('t', 'rejected', 11, 's', 246, 90)"
                )
            )
        with engine.connect() as conn:
            assert conn.execute(totals).all() == [("empty", 1, 7), ("t", 12, 246)]
            assert conn.execute(cuts).all() == [
                ("accepted", 46),
                ("rejected", 0),
                ("accepted", 145),
                ("accepted", 245),
                ("rejected", 0),
            ]
        engine.dispose()


def test_0033_keeps_the_feedback_keys_kept_before_as_digests_a_replay_still_finds(server_url: str) -> None:
    from worker.core.calibration import ObservationIn

    with fresh_database(server_url, "feedback_keys") as url:
        db.upgrade(url, "0032")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO calibration_observations (coverage, answer_kept, origin, dedupe_key) VALUES "
                    "(0.5, true, 'ui', 'key:alice-2024-03-15'), (0.5, true, 'ui', 'compaction:abc'), "
                    f"(0.5, true, 'ui', NULL), (0.5, true, 'ui', 'key:{'a' * 64}')"
                )
            )
        db.upgrade(url)
        with engine.connect() as conn:
            keys = (
                conn.execute(text("SELECT dedupe_key FROM calibration_observations ORDER BY id"))
                .scalars()
                .all()
            )
        engine.dispose()
    replay = ObservationIn(0.5, True, "ui", idempotency_key="alice-2024-03-15").dedupe_key()
    hex_key = ObservationIn(0.5, True, "ui", idempotency_key="a" * 64).dedupe_key()  # a sha256 as a key
    assert keys == [replay, "compaction:abc", None, hex_key]


# What alembic's comparison does not look at: a CHECK constraint's condition (adding an outcome, status
# or counter to the models without a migration failed only at run time, inside a writer's transaction),
# and an index's method, operator classes and WHERE (a changed partial predicate silently stopped the
# planner from using it). As for generated columns: each is built from the models on a scratch copy of
# the migrated table, and Postgres's renderings of the two must agree.
_CHECKS_OF = text(
    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
    "WHERE conrelid = CAST(:table AS regclass) AND contype = 'c'"
)
_CHECK_NAMED = text(
    "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
    "WHERE conrelid = CAST(:table AS regclass) AND conname = :name"
)
_INDEX_OF = text(
    "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = CAST(:table AS regclass) AND c.relname = :name"
)


def _without_table(indexdef: str | None) -> str | None:
    return None if indexdef is None else re.sub(r" ON \S+ USING ", " ON t USING ", indexdef)


def test_0037_refuses_a_source_id_holding_a_pipe_and_says_what_to_do(server_url: str) -> None:
    """'|' joins source and slug in jobs', checkpoints' and erasures' keys: a page of source "a|b" and
    slug "c" and one of source "a" and slug "b|c" shared them. The app refused it; a row written around
    it (a restore, a script) was taken."""
    insert = (
        "INSERT INTO pages (source_id, slug, type, content_hash) VALUES (:source, 'c', 'conversation', 'h')"
    )
    with fresh_database(server_url, "pipes") as url:
        db.upgrade(url, "0036")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(text(insert), {"source": "a|b"})
        with pytest.raises(db.MigrationRefusedError, match=r"some page has a source id holding '\|'"):
            db.upgrade(url)
        with engine.begin() as conn:
            conn.execute(text("UPDATE pages SET source_id = replace(source_id, '|', '-')"))
        db.upgrade(url)
        with pytest.raises(IntegrityError, match="ck_pages_source_id"), engine.begin() as conn:
            conn.execute(text(insert), {"source": "x|y"})
        engine.dispose()


def test_0038_refuses_a_pipe_written_while_0037_ran_and_says_what_to_do(server_url: str) -> None:
    """0037 adds its constraint NOT VALID after checking the rows; one written between the two is
    found by 0038's VALIDATE, which said so as an IntegrityError traceback."""
    with fresh_database(server_url, "pipes_late") as url:
        db.upgrade(url, "0037")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:  # the constraint as 0037 left it, with a row it never checked
            definition = conn.execute(_CHECK_NAMED, {"table": "pages", "name": "ck_pages_source_id"}).scalar()
            assert definition is not None and definition.endswith("NOT VALID")
            conn.execute(text("ALTER TABLE pages DROP CONSTRAINT ck_pages_source_id"))
            conn.execute(
                text(
                    "INSERT INTO pages (source_id, slug, type, content_hash) "
                    "VALUES ('a|b', 'c', 'conversation', 'h')"
                )
            )
            conn.execute(text(f"ALTER TABLE pages ADD CONSTRAINT ck_pages_source_id {definition}"))
        with pytest.raises(db.MigrationRefusedError, match=r"written while 0037 ran.*upgrade again"):
            db.upgrade(url)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0037"
            conn.execute(text("UPDATE pages SET source_id = replace(source_id, '|', '-')"))
        db.upgrade(url)
        with engine.begin() as conn:
            definition = conn.execute(_CHECK_NAMED, {"table": "pages", "name": "ck_pages_source_id"}).scalar()
        assert definition is not None and "NOT VALID" not in definition
        engine.dispose()


def test_checks_and_index_definitions_match_models(server_url: str) -> None:
    tables = [t for t in models.Base.metadata.sorted_tables if t.schema is None]
    checked = {"checks": 0, "indexes": 0}
    with fresh_database(server_url, "definitions") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        preparer = engine.dialect.identifier_preparer
        with engine.begin() as conn:
            for table in tables:
                conn.execute(text(f"CREATE TEMP TABLE scratch (LIKE {table.name} INCLUDING GENERATED)"))
                migrated = dict(conn.execute(_CHECKS_OF, {"table": table.name}).all())
                # A check only the migrations made (or one a model dropped without a migration): alembic
                # compares no CHECK constraints, and the loop below looks up the models' only.
                modelled_names = {
                    preparer.format_constraint(c) for c in table.constraints if isinstance(c, CheckConstraint)
                }
                assert set(migrated) <= modelled_names, (table.name, set(migrated) - modelled_names)
                for check in (c for c in table.constraints if isinstance(c, CheckConstraint)):
                    name = preparer.format_constraint(check)
                    condition = check.sqltext.compile(engine, compile_kwargs={"literal_binds": True})
                    conn.execute(text(f"ALTER TABLE scratch ADD CONSTRAINT {name} CHECK ({condition})"))
                    modelled = conn.scalar(_CHECK_NAMED, {"table": "scratch", "name": name})
                    assert migrated.get(name) == modelled, (table.name, name, migrated.get(name), modelled)
                    checked["checks"] += 1
                for index in table.indexes:
                    ddl = str(CreateIndex(index).compile(engine)).replace(
                        f" ON {table.name} ", " ON scratch ", 1
                    )
                    conn.execute(text(ddl))
                    name = preparer.format_index(index)
                    mine = _without_table(conn.scalar(_INDEX_OF, {"table": table.name, "name": name}))
                    theirs = _without_table(conn.scalar(_INDEX_OF, {"table": "scratch", "name": name}))
                    assert mine == theirs, (table.name, name, mine, theirs)
                    checked["indexes"] += 1
                conn.execute(text("DROP TABLE scratch"))
        engine.dispose()
    assert checked["checks"] > 10 and checked["indexes"] > 10, checked


def test_a_migration_gives_up_a_lock_the_service_holds_and_tries_again(
    server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A long transaction of the running service held jobs: 0035's ALTER waited for it, and every new
    query of jobs (claims, the sweeper, the API's job reads) queued behind the ALTER for as long. Now it
    waits at most its lock_timeout, and the upgrade goes on again from it until the lock comes free."""
    import logging
    import threading

    with fresh_database(server_url, "locktimeout") as url:
        db.upgrade(url, "0034")
        engine = create_engine(url, poolclass=pool.NullPool)
        holder = engine.connect()
        holder.execute(text("LOCK TABLE jobs IN ACCESS SHARE MODE"))  # a long read of jobs, in flight
        errors: list[BaseException] = []

        def migrate() -> None:
            try:
                db.upgrade(url, lock_timeout=0.2, tries=200, wait=0.05)
            except BaseException as exc:
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="worker.db"):
            upgrading = threading.Thread(target=migrate)
            upgrading.start()
            for _ in range(400):
                if "waited 0.2 s for a lock" in caplog.text:
                    break
                threading.Event().wait(0.05)
            assert "waited 0.2 s for a lock" in caplog.text, "it never gave the lock up"
            with engine.connect() as reader:  # a new query of jobs is not stuck behind the ALTER
                reader.execute(text("SET lock_timeout = '2s'"))
                assert reader.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
            holder.rollback()
            holder.close()
            upgrading.join(timeout=60)
        engine.dispose()
        assert not errors and db.pending_revisions(url) == [], errors


def test_a_migration_that_postgres_ends_for_a_deadlock_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """0016 locks tables in another order than a segment's commit writes them: Postgres ended one of
    the two, and when it was the migration, the upgrade failed at once (a lock timeout was tried again,
    a deadlock, as safe, was not)."""
    import logging

    import psycopg
    from sqlalchemy.exc import OperationalError

    from alembic import command

    calls: list[str] = []

    def upgrade(config: object, revision: str) -> None:
        calls.append(revision)
        if len(calls) == 1:
            raise OperationalError(
                "LOCK TABLE extraction_audit IN SHARE MODE", {}, psycopg.errors.DeadlockDetected()
            )

    monkeypatch.setattr(command, "upgrade", upgrade)
    with caplog.at_level(logging.WARNING, logger="worker.db"):
        db.upgrade("postgresql+psycopg://127.0.0.1:9/none", tries=3, wait=0.01)
    assert calls == ["head", "head"]
    assert "met a deadlock with the running service" in caplog.text


def test_a_downgrade_that_would_forget_what_is_owed_refuses(server_url: str) -> None:
    """Past 0028 the provider batches still owed a delete (the pages' text, maybe of erased pages) were
    dropped with their table, and past 0009 the checkpoints' lists of skipped segments: nothing said so,
    and neither could come back. Each refuses while it holds any."""
    from alembic import command

    with fresh_database(server_url, "owed") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO provider_copies (provider, batch_id) VALUES ('openai', 'batch_1')")
            )
        with pytest.raises(RuntimeError, match="1 provider batch"):
            command.downgrade(db.alembic_config(url), "0027")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM provider_copies"))
            # A call the upgrade to 0026 admits overflowed the narrowing back midway.
            conn.execute(
                text(
                    "INSERT INTO llm_calls (provider, model, purpose, latency_ms, outcome, cost_usd) "
                    "VALUES ('openai', 'm', 'extraction', 1, 'ok', 1234567.5)"
                )
            )
        with pytest.raises(RuntimeError, match=r"1 LLM call\(s\) cost \$1,000,000 or more"):
            command.downgrade(db.alembic_config(url), "0025")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM llm_calls"))
            # Past 0013 a batch still at the provider was dropped with its table: never collected, its
            # copy of the pages never deleted nor owed.
            backfill = conn.execute(
                text("INSERT INTO backfills (source_id) VALUES ('s') RETURNING id")
            ).scalar_one()
            conn.execute(
                text(
                    "INSERT INTO backfill_batches (backfill_id, key, provider, model, status) "
                    "VALUES (:b, 'k', 'openai', 'm', 'submitted')"
                ),
                {"b": backfill},
            )
        with pytest.raises(
            RuntimeError, match=r"1 provider batch\(es\) of backfills are still at the provider"
        ):
            command.downgrade(db.alembic_config(url), "0012")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM backfills"))
        command.downgrade(db.alembic_config(url), "0009")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO op_checkpoints (op, fingerprint, page_key, completed_key, messages_done, "
                    "prefix_hash, next_row_num, skipped) VALUES ('x', 'f', 'p', 'k', 0, 'h', 0, '[\"s\"]')"
                )
            )
        with pytest.raises(RuntimeError, match="1 page checkpoint"):
            command.downgrade(db.alembic_config(url), "0008")
        engine.dispose()


def test_the_transcript_list_and_a_listed_pages_latest_job_are_read_in_an_indexs_order(session) -> None:
    """Each read every row of its table (or of its subject) and sorted them: the transcripts for every
    GET /v1/transcripts, a page's every extraction job for each page listed (migration 0048)."""
    from sqlalchemy import event

    from worker.compaction.views import recent_transcripts
    from worker.extraction.catalog import list_pages

    session.execute(text("SET LOCAL enable_seqscan = off"))  # empty tables: make an index the choice
    plans: list[str] = []

    def explain(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "FROM transcripts" in statement or "FROM pages" in statement:
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
        return statement, parameters

    event.listen(session.get_bind(), "before_cursor_execute", explain, retval=True)
    try:
        recent_transcripts(session, 10)
        list_pages(session, limit=10)
    finally:
        event.remove(session.get_bind(), "before_cursor_execute", explain)
    transcripts, pages = plans
    assert "ix_transcripts_updated_at" in transcripts and "Sort" not in transcripts, transcripts
    assert "Index Scan Backward using ix_jobs_subject_id" in pages and "Sort" not in pages, pages
