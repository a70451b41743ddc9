"""A database error from a connection that never opened, told in one line (the CLI's exit for it)."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from worker.core.errors import connection_failure


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
