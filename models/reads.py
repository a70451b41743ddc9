"""Units of work in autocommit: reads that end without a ROLLBACK, and writes of one statement.

psycopg forgets every statement it prepared on a connection when a transaction there rolls back
(it cannot know whether the transaction dropped an object one of them uses). A read-only session
closes by rolling back, so on a worker's connections, where a page reads twice or three times between
its commits, the statements every segment runs were never prepared: each was parsed and planned anew
(pg_stat_statements: as many plans as calls). A read in autocommit opens no transaction, so there is
nothing to roll back, and it saves the BEGIN and ROLLBACK round trips too.

Use ``read_only`` for a unit that runs one statement, or several that need not see one snapshot;
``one_statement`` for a write that is a single statement, which is atomic on its own: it then runs
without the BEGIN and COMMIT round trips a transaction adds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

_AUTOCOMMIT = {"isolation_level": "AUTOCOMMIT"}


@contextmanager
def read_only(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose statements each run in autocommit; it writes nothing and needs no commit.

    A factory bound to a connection (a test's outer transaction with savepoints) reads inside that
    connection's transaction instead: its isolation level cannot change while it is open.
    """
    with factory() as session:
        if isinstance(session.get_bind(), Engine):
            session.connection(execution_options=_AUTOCOMMIT)
        yield session


@contextmanager
def one_snapshot(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A read-only session whose statements all see one snapshot (a REPEATABLE READ transaction, rolled
    back at the end): figures read by several statements agree with each other though writers commit
    between them. On a factory bound to a connection it reads in that connection's transaction."""
    with factory() as session:
        if isinstance(session.get_bind(), Engine):
            session.connection(
                execution_options={"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            )
        yield session


@contextmanager
def one_statement(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session for a write of a single statement, committed as it runs (in autocommit).

    On a factory bound to a connection it runs in a savepoint of that connection's transaction,
    released when the block ends, as ``factory.begin()`` would.
    """
    with read_only(factory) as session:
        yield session
        session.commit()  # in autocommit no COMMIT is sent: the statement committed as it ran
