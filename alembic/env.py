"""Alembic environment: URL from the caller (tests, CLI) or from Factmill's settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from logging.config import fileConfig
from typing import Any

from alembic import context
from models import Base

config = context.config
if config.config_file_name is not None and not config.attributes.get("database_url"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    from worker.db import database_url

    return database_url()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


class _StepTimer:
    """Tells the caller's ``on_step`` (worker.db.upgrade) of each migration as it finishes."""

    def __init__(self, on_step: Callable[[str, float, str], None]) -> None:
        self.on_step = on_step
        self.started = time.monotonic()

    def __call__(self, *, step: Any, **_: Any) -> None:
        now = time.monotonic()
        script = step.up_revision  # the migration run, either way (a downgrade undoes it)
        # The docstring's first paragraph (its title, which may wrap over lines), on one line.
        title = (getattr(script, "longdoc", "") or "").strip().split("\n\n", 1)[0]
        self.on_step(str(step.up_revision_id), now - self.started, " ".join(title.split()))
        self.started = now


MIGRATIONS_LOCK_ID = 0x666D_6D69_6772  # "fmmigr": an advisory lock key of its own
MIGRATIONS_LOCK_POLL_SECONDS = 0.5


def run_migrations_online() -> None:
    from sqlalchemy import create_engine, pool, text

    on_step = config.attributes.get("on_step")
    extra = {"on_version_apply": _StepTimer(on_step)} if on_step is not None else {}
    from worker.db import connect_args
    from worker.settings import get_settings

    url = _url()
    # A silent server must not hang the migrate step for ever (worker.db.connect_args).
    timeout = get_settings().db_connect_timeout_seconds
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=connect_args(url, timeout))
    with engine.connect() as connection:
        # One upgrade at a time: a second one (a repeated migrate step, `factmill demo` beside `db
        # upgrade`) waits here, then reads the version the first committed and has nothing to do; it
        # ran the same migrations and failed on a duplicate table, "rolled back", exit 1. A session lock,
        # held across the migrations' own transactions (and let go with the connection). Asked for again
        # and again rather than waited on: a session waiting inside a statement is a transaction, which
        # the first upgrade's CREATE INDEX CONCURRENTLY waits for (0039), while it waits for the lock.
        while not connection.execute(
            text("SELECT pg_try_advisory_lock(:id)"), {"id": MIGRATIONS_LOCK_ID}
        ).scalar():
            connection.commit()
            time.sleep(MIGRATIONS_LOCK_POLL_SECONDS)
        # Then each migration waits at most this long for a table's lock (worker.db.upgrade says why,
        # and tries again): for the session, so every migration's transaction has it.
        lock_timeout_ms = int(config.attributes.get("lock_timeout_ms") or 0)
        if lock_timeout_ms:
            connection.execute(text(f"SET lock_timeout = {lock_timeout_ms}"))
        connection.commit()
        # Each migration commits on its own: in one transaction, the first one's locks (an ALTER of
        # llm_calls, which every segment commit writes) were held until the last one (an index over
        # facts) was built, so extraction and search waited out the whole upgrade. One that fails
        # leaves the schema at the migration before it; running the upgrade again goes on from there.
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            compare_type=True,
            transaction_per_migration=True,
            **extra,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATIONS_LOCK_ID})
        connection.commit()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
