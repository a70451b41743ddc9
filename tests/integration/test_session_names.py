"""Postgres sessions say which process opened them (worker.db), and the tests' TRUNCATE that waits out a
lock says who held it (tests/locks.py): a held lock once timed three tests out with no word of its holder."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import make_url, text

from tests.conftest import TABLES
from tests.locks import TruncateBlocked, truncate_all
from worker import db
from worker.settings import Settings

pytestmark = pytest.mark.integration


def test_each_connection_is_named_after_the_process_that_opened_it(database_url: str) -> None:
    with db.get_engine(database_url).connect() as conn:
        assert conn.scalar(text("SELECT current_setting('application_name')")) == f"factmill/{os.getpid()}"


def test_a_name_the_url_gives_is_kept(database_url: str) -> None:
    named = make_url(database_url).update_query_dict({"application_name": "reporting"})  # (a host= kept)
    engine = db.create_pooled_engine(named.render_as_string(hide_password=False), settings=Settings())
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT current_setting('application_name')")) == "reporting"
    finally:
        engine.dispose()


def test_a_truncate_that_waits_out_its_lock_timeout_names_the_holder(database_url: str) -> None:
    with db.get_engine(database_url).connect() as holder:
        holder.execute(text("LOCK TABLE pages IN ACCESS SHARE MODE"))
        holder_pid = holder.scalar(text("SELECT pg_backend_pid()"))
        with pytest.raises(TruncateBlocked) as blocked:
            truncate_all(database_url, TABLES, lock_timeout="300ms")
        holder.rollback()
    report = str(blocked.value)
    line = next(each for each in report.splitlines() if each.startswith(f"pid {holder_pid} "))
    assert f"factmill/{os.getpid()} (this test process)" in line
    assert "idle in transaction" in line and "pages AccessShareLock" in line
    assert "this process's threads:" in report
