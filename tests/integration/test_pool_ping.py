"""worker.db's pool pings a connection that sat idle, and only then: against a real Postgres whose
backend for the pooled connection is terminated (what a server restart does to every connection)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from worker import db

pytestmark = pytest.mark.integration


def backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT pg_backend_pid()")))


def terminate(database_url: str, pid: int) -> None:
    with db.get_engine(database_url).connect() as conn:
        assert conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        conn.commit()


@pytest.fixture
def engines(database_url: str) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


def test_a_connection_idle_past_the_threshold_is_pinged_and_replaced_when_its_server_is_gone(
    database_url: str, engines: list[Engine]
) -> None:
    engine = db.create_pooled_engine(database_url, ping_after_idle=0.0)  # any reuse counts as idle
    engines.append(engine)
    first = backend_pid(engine)
    assert backend_pid(engine) == first  # pinged, alive: the same pooled connection
    terminate(database_url, first)
    assert backend_pid(engine) != first  # the ping saw it gone: reconnected, the caller saw nothing


def test_a_connection_reused_within_the_threshold_is_not_pinged(
    database_url: str, engines: list[Engine]
) -> None:
    engine = db.create_pooled_engine(database_url, ping_after_idle=3600.0)
    engines.append(engine)
    first = backend_pid(engine)
    terminate(database_url, first)
    # No ping: the dead connection is handed out and its first statement fails, as a statement in
    # flight at an outage does; the pool is invalidated, so the next checkout reconnects.
    with pytest.raises(OperationalError) as failed:
        backend_pid(engine)
    assert failed.value.connection_invalidated
    assert backend_pid(engine) != first
