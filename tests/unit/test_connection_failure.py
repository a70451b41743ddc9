"""A database error from a connection that never opened, told in one line (the CLI's exit for it)."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import InternalError, OperationalError

from worker.core.errors import connection_failure, database_outage
from worker.db import database_unavailable


def test_a_connection_that_never_opened_is_told_in_one_line_and_nothing_else_is() -> None:
    engine = create_engine("postgresql+psycopg://factmill:secret@127.0.0.1:1/factmill")
    with pytest.raises(OperationalError) as caught:
        engine.connect()
    reason = connection_failure(caught.value)
    assert reason is not None and reason.startswith('connection to server at "127.0.0.1", port 1 failed')
    assert "\n" not in reason and "secret" not in reason
    assert connection_failure(ValueError("x")) is None
    assert connection_failure(OperationalError("SELECT 1", {}, psycopg_error_with_sqlstate())) is None


def psycopg_error_with_sqlstate() -> Exception:
    """A server-side error (it has a SQLSTATE): the server was reached."""
    return psycopg.errors.lookup("57014")("canceling statement due to statement timeout")


def test_a_server_that_failed_once_connected_is_an_outage_and_a_statement_s_own_error_is_not() -> None:
    shutdown = OperationalError("SELECT 1", {}, psycopg.errors.lookup("57P01")("terminating connection"))
    assert database_outage(shutdown) == "OperationalError: AdminShutdown (SQLSTATE 57P01)"
    assert database_outage(OperationalError("SELECT 1", {}, psycopg_error_with_sqlstate())) is None
    never_opened = OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused"))
    assert database_outage(never_opened) is None and connection_failure(never_opened) is not None
    broke = OperationalError("SELECT 1", {}, psycopg.OperationalError("server closed the connection"))
    broke.connection_invalidated = True  # open, then broken mid-command: part of it may have committed
    assert connection_failure(broke) is None
    assert database_outage(broke) == "OperationalError: OperationalError: server closed the connection"


def test_a_server_that_refuses_writes_is_an_outage_and_other_internal_errors_are_not() -> None:
    read_only = InternalError(
        "UPDATE x", {}, psycopg.errors.lookup("25006")("cannot execute UPDATE in a read-only transaction")
    )
    assert database_outage(read_only) == "InternalError: ReadOnlySqlTransaction (SQLSTATE 25006)"
    assert database_unavailable(read_only)  # the API says 503, a job is requeued
    other = InternalError("SELECT 1", {}, psycopg.errors.lookup("XX000")("internal error"))
    assert database_outage(other) is None and not database_unavailable(other)
