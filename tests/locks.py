"""Lock-order tests: seeing another transaction of the test wait on a row lock before going on."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

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
