"""worker.db's pool pings a connection that sat idle, and only then: against a real Postgres whose
backend for the pooled connection is terminated (what a server restart does to every connection)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from worker import db
from worker.core.errors import error_summary
from worker.settings import Settings

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


def live_backends(database_url: str, pids: set[int]) -> set[int]:
    with db.get_engine(database_url).connect() as conn:
        rows = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE pid = ANY(:pids)"), {"pids": list(pids)}
        )
        return {int(pid) for (pid,) in rows}


def test_the_pool_keeps_db_pool_size_connections_and_closes_a_burst_beyond_them(
    database_url: str, engines: list[Engine]
) -> None:
    settings = Settings(database_url=database_url, db_pool_size=12, db_max_overflow=4)
    engine = db.create_pooled_engine(database_url, settings=settings)
    engines.append(engine)

    def burst(size: int) -> set[int]:
        with contextlib.ExitStack() as stack:
            conns = [stack.enter_context(engine.connect()) for _ in range(size)]
            return {int(conn.scalar(text("SELECT pg_backend_pid()"))) for conn in conns}

    kept = burst(12)
    assert len(kept) == 12
    assert burst(12) == kept  # every one kept: the same backends serve the next burst
    widest = burst(16)  # four past what the pool keeps: opened for the burst, closed when returned
    assert kept < widest and len(widest) == 16
    assert engine.pool.checkedin() == 12  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while len(live_backends(database_url, widest)) > 12 and time.monotonic() < deadline:
        time.sleep(0.05)  # a closed connection's backend exits a moment later
    assert len(live_backends(database_url, widest)) == 12  # which four closed is the pool's choice


def test_the_pool_hands_out_the_connection_returned_last(database_url: str, engines: list[Engine]) -> None:
    engine = db.create_pooled_engine(database_url, settings=Settings(db_pool_size=3, db_max_overflow=0))
    engines.append(engine)
    first, second, third = (engine.connect() for _ in range(3))
    pids = [int(conn.scalar(text("SELECT pg_backend_pid()"))) for conn in (first, second, third)]
    for conn in (first, second, third):  # returned in this order: the third is the warmest
        conn.close()
    assert backend_pid(engine) == pids[2]
    assert backend_pid(engine) == pids[2]  # and again: the others stay idle


def test_an_engine_s_errors_never_show_the_values_a_statement_was_given(
    database_url: str, engines: list[Engine]
) -> None:
    """A statement's values are pages' text and facts; its errors reach logs and jobs' last_error."""
    engine = db.create_pooled_engine(database_url)
    engines.append(engine)
    secret = "Alice's private diagnosis"
    with pytest.raises(OperationalError) as failed, engine.begin() as conn:
        conn.execute(text("SET LOCAL statement_timeout = 10"))
        conn.execute(text("SELECT pg_sleep(1), CAST(:fact AS text)"), {"fact": secret})
    assert secret not in str(failed.value) and "parameters hidden" in str(failed.value)
    assert error_summary(failed.value) == "OperationalError: QueryCanceled (SQLSTATE 57014)"


def test_connections_give_up_on_a_silent_server_and_the_url_keeps_its_own_choices(database_url: str) -> None:
    # libpq waits for ever on a connect and the kernel for many minutes on an open connection when the
    # server's packets are dropped (a failover, a partition): /readyz, /metrics and claims hung with it.
    settings = Settings(db_pool_size=1, db_max_overflow=0, db_connect_timeout_seconds=7)
    named = database_url + ("&" if "?" in database_url else "?") + "keepalives_idle=11"
    for url, idle in ((database_url, "30"), (named, "11")):
        engine = db.create_pooled_engine(url, settings=settings)
        try:
            with engine.connect() as conn:
                parameters = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
        finally:
            engine.dispose()
        assert parameters["connect_timeout"] == "7"
        assert (parameters["keepalives"], parameters["keepalives_idle"]) == ("1", idle)
        assert parameters["tcp_user_timeout"] == "60000"
