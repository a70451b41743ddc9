"""Lock-order tests: seeing another transaction of the test wait on a row lock before going on; the
fixtures' TRUNCATE, which says who held a lock it waited out."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.db import APPLICATION_NAME_PREFIX

_WAITING = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND query ILIKE :like"
)


def waits_on_a_lock(
    factory: sessionmaker[Session], running: Future[Any] | None = None, like: str = "%", timeout: float = 20
) -> bool:
    """Whether a backend of the test database waits on a lock (its statement ILIKE ``like``) before
    ``running`` (when given) ends or ``timeout`` seconds pass; polled every 10 ms."""
    deadline = time.monotonic() + timeout
    while (running is None or not running.done()) and time.monotonic() < deadline:
        with factory() as probe:
            if probe.scalar(_WAITING, {"like": like}):
                return True
        time.sleep(0.01)
    return False


class TruncateBlocked(AssertionError):
    """The fixtures' TRUNCATE waited its lock timeout out: says which sessions held the database."""


_OTHER_SESSIONS = text(
    "SELECT a.pid, coalesce(a.application_name, '') AS app, a.state, a.backend_type,"
    " extract(epoch FROM now() - a.xact_start)::int AS xact_seconds,"
    " extract(epoch FROM now() - a.state_change)::int AS state_seconds,"
    " left(regexp_replace(coalesce(a.query, ''), '\\s+', ' ', 'g'), 200) AS query,"
    " (SELECT string_agg(DISTINCT c.relname || ' ' || l.mode, ', ') FROM pg_locks l"
    "  JOIN pg_class c ON c.oid = l.relation WHERE l.pid = a.pid AND l.granted"
    "  AND c.relnamespace <> 'pg_catalog'::regnamespace) AS locks"
    " FROM pg_stat_activity a WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"
    " ORDER BY a.xact_start NULLS LAST"
)


def sessions_report(factory: sessionmaker[Session]) -> str:
    """Every other session of the test database: its process (``factmill/<pid>`` is the application name
    worker.db gives; this test process's own threads are dumped), state, transaction age, locks, query."""
    with factory() as probe:
        rows = probe.execute(_OTHER_SESSIONS).all()
    lines = []
    ours = False
    for row in rows:
        owner = row.app
        if row.app == f"{APPLICATION_NAME_PREFIX}{os.getpid()}":
            owner, ours = f"{row.app} (this test process)", True
        elif row.app.startswith(APPLICATION_NAME_PREFIX):
            owner = f"{row.app} ({_command_line(row.app.removeprefix(APPLICATION_NAME_PREFIX))})"
        lines.append(
            f"pid {row.pid} {owner or row.backend_type}: {row.state}, transaction {row.xact_seconds} s,"
            f" state {row.state_seconds} s, locks [{row.locks or ''}], query: {row.query}"
        )
    if ours:
        lines.append("this process's threads:\n" + _thread_stacks())
    return "\n".join(lines) or "no other session"


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "not a process of this machine, or gone"


def _thread_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)[-8:])
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    )


def truncate_all(url: str, tables: str, lock_timeout: str = "90s") -> None:
    """Empty ``tables``. A worker process the test started may still be writing (an embedding follow-up
    after its job ended): its row locks and the TRUNCATE's table locks can deadlock, and Postgres then
    ends one of the two, here the TRUNCATE: tried again. A lock held past ``lock_timeout`` (a session an
    earlier test left in a transaction) fails at once with the sessions that held it, instead of
    waiting out pytest's timeout with no word of who held it."""
    engine = db.get_engine(url)
    for attempt in range(5):
        try:
            with engine.begin() as conn:
                conn.execute(text(f"SET LOCAL lock_timeout = '{lock_timeout}'"))
                conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
            return
        except OperationalError as exc:
            if db.lock_timed_out(exc):
                report = sessions_report(sessionmaker(engine))
                raise TruncateBlocked(
                    f"TRUNCATE waited {lock_timeout} for a lock; sessions:\n{report}"
                ) from exc
            if attempt == 4 or not db.deadlocked(exc):
                raise
            time.sleep(0.2)
