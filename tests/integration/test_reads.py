"""models.reads.read_only against a real Postgres: a read ends without a ROLLBACK, so psycopg keeps the
statements it prepared on the connection (a rolled-back transaction makes it forget them all)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from models.reads import one_snapshot, one_statement, read_only
from worker import db
from worker.settings import Settings

pytestmark = pytest.mark.integration

PROBE = text("SELECT count(*) FROM pg_class WHERE relname = :name")
PREPARED = text(
    "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT count(*) FROM pg_class%'"
)


@pytest.fixture
def one_connection(database_url: str) -> Iterator[Engine]:
    """An engine whose pool holds one connection, so every unit of work runs on the same one."""
    engine = db.create_pooled_engine(database_url, settings=Settings(db_pool_size=1, db_max_overflow=0))
    yield engine
    engine.dispose()


def prepared_after_reads(factory: sessionmaker[Session], reads: int, *, autocommit: bool) -> int:
    for _ in range(reads):
        if autocommit:
            with read_only(factory) as session:
                session.execute(PROBE, {"name": "pg_class"})
        else:
            with factory() as session:  # a read in a transaction: it ends by rolling back
                session.execute(PROBE, {"name": "pg_class"})
    with read_only(factory) as session:
        return int(session.scalar(PREPARED) or 0)


def test_reads_in_autocommit_keep_the_prepared_statement_a_rolled_back_read_loses(
    one_connection: Engine,
) -> None:
    factory = sessionmaker(one_connection)
    # psycopg prepares a statement on its sixth run; the rollback ending each transactional read
    # forgets it again.
    assert prepared_after_reads(factory, 8, autocommit=False) == 0
    assert prepared_after_reads(factory, 8, autocommit=True) == 1


def test_a_read_in_autocommit_opens_no_transaction(one_connection: Engine) -> None:
    factory = sessionmaker(one_connection)
    with read_only(factory) as session:
        # In autocommit each statement is a transaction of its own; inside one, a later statement
        # starts after the transaction did.
        session.execute(text("SELECT 1"))
        assert session.scalar(text("SELECT statement_timestamp() = transaction_timestamp()")) is True
    with factory() as session:
        session.execute(text("SELECT 1"))
        assert session.scalar(text("SELECT statement_timestamp() = transaction_timestamp()")) is False


def test_a_factory_bound_to_an_open_transaction_reads_inside_it(one_connection: Engine) -> None:
    with one_connection.connect() as conn:
        conn.execute(text("CREATE TEMP TABLE probe (n int) ON COMMIT DROP"))
        conn.execute(text("INSERT INTO probe VALUES (1)"))
        factory = sessionmaker(bind=conn, join_transaction_mode="create_savepoint")
        with read_only(factory) as session:  # sees the outer transaction's uncommitted row
            assert session.scalar(text("SELECT count(*) FROM probe")) == 1
        conn.rollback()


def test_one_statement_commits_a_write_without_a_transaction_around_it(
    one_connection: Engine, database_url: str
) -> None:
    factory = sessionmaker(one_connection)
    name = f"probe_{uuid.uuid4().hex[:12]}"
    with one_statement(factory) as session:
        session.execute(text(f"CREATE TABLE {name} (n int)"))
    try:
        with one_statement(factory) as session:
            # No transaction around the statement: it starts as a transaction of its own would.
            session.execute(
                text(f"INSERT INTO {name} SELECT 1 WHERE statement_timestamp() = transaction_timestamp()")
            )
        other = db.create_pooled_engine(database_url, settings=Settings(db_pool_size=1, db_max_overflow=0))
        try:
            with other.connect() as conn:  # another connection sees it: it is committed
                assert conn.scalar(text(f"SELECT count(*) FROM {name}")) == 1
        finally:
            other.dispose()
        with pytest.raises(ProgrammingError), one_statement(factory) as session:
            session.execute(text(f"INSERT INTO {name} SELECT n FROM no_such_table_{name}"))
        with read_only(factory) as session:
            assert session.scalar(text(f"SELECT count(*) FROM {name}")) == 1
    finally:
        with one_statement(factory) as session:
            session.execute(text(f"DROP TABLE {name}"))


def test_one_statement_on_a_factory_bound_to_a_transaction_writes_inside_it(one_connection: Engine) -> None:
    with one_connection.connect() as conn:
        conn.execute(text("CREATE TEMP TABLE probe (n int)"))
        factory = sessionmaker(bind=conn, join_transaction_mode="create_savepoint")
        with one_statement(factory) as session:
            session.execute(text("INSERT INTO probe VALUES (1)"))
        assert conn.scalar(text("SELECT count(*) FROM probe")) == 1  # its savepoint was released
        conn.rollback()  # and the outer transaction's rollback takes it back
        assert conn.scalar(text("SELECT count(to_regclass('pg_temp.probe'))")) == 0
        conn.rollback()


def test_one_snapshot_reads_what_was_committed_when_it_began_and_writes_nothing(database_url: str) -> None:
    """A page of figures read by several statements (GET /v1/calibration: the active version, then the
    history) showed a version activated between them as both active and not."""
    engine = db.create_pooled_engine(database_url, settings=Settings(db_pool_size=2, db_max_overflow=0))
    factory = sessionmaker(engine)
    table = f"snap_{uuid.uuid4().hex[:8]}"
    try:
        with factory.begin() as session:
            session.execute(text(f"CREATE TABLE {table} (n int)"))
        with one_snapshot(factory) as reader:
            assert reader.scalar(text(f"SELECT count(*) FROM {table}")) == 0
            with factory.begin() as writer:
                writer.execute(text(f"INSERT INTO {table} VALUES (1)"))
            assert reader.scalar(text(f"SELECT count(*) FROM {table}")) == 0  # the same snapshot
            with pytest.raises(Exception, match="read-only transaction"):
                reader.execute(text(f"INSERT INTO {table} VALUES (2)"))
        with read_only(factory) as session:
            assert session.scalar(text(f"SELECT count(*) FROM {table}")) == 1
    finally:
        with factory.begin() as session:
            session.execute(text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()
