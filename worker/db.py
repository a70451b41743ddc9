"""Database engine, sessions and migrations, resolved from Settings (server URL or embedded)."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import InvalidatePoolError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random

from worker.core.errors import (
    DATABASE_GONE_SQLSTATES,
    InvalidSettingsError,
    MigrationsMissingError,
    refused_as_read_only,
    server_state_failed,
)
from worker.embedded import embedded_postgres_url, to_sqlalchemy_url
from worker.settings import Settings, get_settings

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


def resource_root() -> Path:
    """Where the migrations and the demo's example pages are: the checkout (an editable install,
    ./dev, the Dockerfile), else the copy a built wheel carries in worker/_bundled (setup.py)."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "alembic" / "env.py").is_file():
        return checkout
    return Path(__file__).resolve().parent / "_bundled"


REPO_ROOT = resource_root()
ALEMBIC_INI = REPO_ROOT / "alembic.ini"
MIGRATIONS = REPO_ROOT / "alembic"


DATABASE_URL_FORM = "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


def database_url(settings: Settings | None = None) -> str:
    """The SQLAlchemy URL to use: FACTMILL_DATABASE_URL, else the embedded Postgres."""
    settings = settings or get_settings()
    if settings.database_url:
        url = to_sqlalchemy_url(settings.database_url)
        problem = url_problem(url)
        if problem:
            raise InvalidSettingsError(f"invalid setting: FACTMILL_DATABASE_URL: {problem}")
        return url
    return embedded_postgres_url(settings.data_dir)


def url_problem(url: str) -> str | None:
    """What is wrong with a database URL, read as SQLAlchemy reads it, or None; never quoting it. A
    port left as a template was a traceback from the first command that connected, and an unescaped
    '@' in the password made part of it the host, which the connection error then printed."""
    try:
        parsed = make_url(url)
        parsed.port  # noqa: B018 (read for its check)
    except Exception:  # ArgumentError, or a port that is no number
        return f"is not a database URL: expected {DATABASE_URL_FORM}"
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        return f"must be a Postgres URL: expected {DATABASE_URL_FORM}"
    if parsed.get_driver_name() != "psycopg":  # another driver: a traceback naming a missing module
        return (
            f"names the {parsed.get_driver_name()} driver; Factmill connects with psycopg 3: "
            f"expected {DATABASE_URL_FORM} (or postgresql+psycopg://)"
        )
    # An '@' the credentials did not take (p@ss, p@ss/w@db) lands in the host or the database name; a
    # database name with an escaped one (x%40y) is no such case.
    unescaped = url.partition("://")[2].partition("?")[0].count("@") > 1
    if unescaped and ("@" in (parsed.host or "") or "@" in (parsed.database or "")):
        return "holds an '@' after its credentials: percent-encode '@' in the password as %40"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"names port {parsed.port}: a port is 1 to 65535"
    return None


# A pooled connection is pinged before use only when it sat idle at least this long. SQLAlchemy's
# pool_pre_ping pings on every checkout: eight round trips a page in a worker (bench/pipeline.py, one
# segment a page: 13.9 -> 5.9 transactions a page, about 9% of the worker's CPU). A connection back in
# use within a second was alive a moment ago; one idle across a Postgres restart (which takes longer
# than that) is pinged and replaced, with every older pooled connection, as pre-ping would do. Only a
# connection both last used and used again within the same second around an outage meets it unpinged:
# that statement fails as one in flight at the outage does (OperationalError, the pool invalidated).
PING_AFTER_IDLE_SECONDS = 1.0


class MigrationRefusedError(RuntimeError):
    """A migration that will not run on the data it found, saying what to do (alembic/versions)."""


def database_went_away(exc: BaseException) -> bool:
    """The database restarted or the connection broke (not a deadlock or a statement timeout, which
    are the statement's own failures). No SQLSTATE at all means the server never answered. Meant for an
    OperationalError (``database_unavailable`` checks that)."""
    if getattr(exc, "connection_invalidated", False):
        return True
    return went_away_by_sqlstate(getattr(getattr(exc, "orig", None), "sqlstate", None))


def went_away_by_sqlstate(sqlstate: str | None) -> bool:
    """``database_went_away`` by a driver error's SQLSTATE alone."""
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in DATABASE_GONE_SQLSTATES


QUERY_CANCELED = "57014"  # a statement_timeout (or a cancel) stopped the statement


def statement_timed_out(exc: BaseException) -> bool:
    """The statement was cancelled by its statement_timeout: the work asked was too long, not a fault."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == QUERY_CANCELED


LOCK_NOT_AVAILABLE = "55P03"  # a lock_timeout (or NOWAIT) gave up waiting for a lock
DEADLOCK_DETECTED = "40P01"


def lock_timed_out(exc: BaseException) -> bool:
    """The statement gave up waiting for a lock (its lock_timeout): others held it, no fault."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == LOCK_NOT_AVAILABLE


def deadlocked(exc: BaseException) -> bool:
    """Postgres ended the transaction to break a deadlock with another: trying again is the answer."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == DEADLOCK_DETECTED


# How many times a transaction Postgres ended to break a deadlock is made: the other side has usually
# committed by the second try (a short random wait lets it).
DEADLOCK_TRIES = 3


def made_again_on_deadlock(work: Callable[..., _T], *args: Any) -> _T:
    """``work(*args)``, made again (up to DEADLOCK_TRIES times in all) when Postgres ended its transaction
    to break a deadlock. ``work`` must own its transaction and touch nothing outside it before the
    commit (nothing sent, nothing counted): what a try did was all rolled back."""
    retrying = Retrying(
        retry=retry_if_exception(deadlocked),
        stop=stop_after_attempt(DEADLOCK_TRIES),
        wait=wait_random(0.05, 0.25),
        reraise=True,
    )
    return retrying(work, *args)


def database_unavailable(exc: BaseException) -> bool:
    """The database cannot serve now, through no fault of the work asked of it: it is unreachable or
    restarting, out of disk, memory or connections, or every pooled connection stayed busy past the
    pool's timeout. The answer is to try again shortly: the API says 503 with Retry-After."""
    if isinstance(exc, PoolTimeoutError):
        return True
    if refused_as_read_only(exc):
        return True
    if not isinstance(exc, OperationalError):
        return False
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return server_state_failed(sqlstate, invalidated=bool(getattr(exc, "connection_invalidated", False)))


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One pooled engine per URL per process."""
    return create_pooled_engine(url)


def connect_args(url: str, connect_timeout: int) -> dict[str, int]:
    """libpq's connect timeout, TCP keepalives (idle 30 s, then 3 probes 10 s apart: an idle connection)
    and TCP user timeout (60 s of data unacknowledged: a statement sent to a silent server, which
    keepalives do not cover): without them a server behind a dropped route hung each connect for
    minutes and each statement until the kernel gave up (about 15 minutes), and /readyz, /metrics and
    workers' claims hung with it. A parameter the URL names itself (``?connect_timeout=3``) is the URL's."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        return {}
    wanted = {
        "connect_timeout": connect_timeout,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "tcp_user_timeout": 60_000,  # milliseconds
    }
    return {name: value for name, value in wanted.items() if name not in parsed.query}


def create_pooled_engine(
    url: str, *, ping_after_idle: float = PING_AFTER_IDLE_SECONDS, settings: Settings | None = None
) -> Engine:
    """An engine whose pool keeps ``db_pool_size`` connections, opens up to ``db_max_overflow`` more for
    a burst, and pings a connection before use once it sat idle ``ping_after_idle`` seconds.

    Its errors never show the statement's bound values (``hide_parameters``): they are pages' text and
    facts, and an error's message reaches logs and jobs' last_error (worker.core.errors)."""
    settings = settings or get_settings()
    engine = create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_use_lifo=True,
        hide_parameters=True,
        connect_args=connect_args(url, settings.db_connect_timeout_seconds),
    )
    _ping_idle_connections(engine, ping_after_idle)
    _name_connections(engine)
    _ENGINES.add(engine)
    return engine


def _name_connections(engine: Engine) -> None:
    """Each connection tells the server which process opened it (``application_name`` ``factmill/<pid>``,
    read at connect time, so a forked child names itself): pg_stat_activity then says which API,
    worker or CLI process holds a transaction or a lock. A name the URL gives is the URL's."""
    if engine.dialect.name != "postgresql" or "application_name" in engine.url.query:
        return

    @event.listens_for(engine, "do_connect")
    def named(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        cparams.setdefault("application_name", f"{APPLICATION_NAME_PREFIX}{os.getpid()}")


APPLICATION_NAME_PREFIX = "factmill/"


# Every engine this process made, so a forked child (Celery's prefork pool) can drop the connections it
# inherited: they are the parent's sockets, and two processes talking on one breaks both ("can't change
# 'autocommit' now: connection in transaction status INTRANS", met once `worker` checked the schema
# before forking). SQLAlchemy's advice for pools across fork: dispose(close=False) in the child.
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)


def _ping_idle_connections(engine: Engine, idle_seconds: float) -> None:
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def checked_in(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def checked_out(dbapi_connection: Any, record: ConnectionPoolEntry, proxy: PoolProxiedConnection) -> None:
        checked_in_at = record.info.get(_CHECKED_IN_AT)
        if checked_in_at is None or time.monotonic() - checked_in_at < idle_seconds:
            return  # just connected, or in use a moment ago
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as err:
            if dialect.is_disconnect(err, dbapi_connection, None):
                # The pool reconnects this one and drops every pooled connection older than now.
                raise InvalidatePoolError() from err
            raise


_CHECKED_IN_AT = "factmill_checked_in_at"


def session_factory(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url or database_url()), expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error, always close."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    if not (MIGRATIONS / "env.py").is_file():
        # Neither a checkout nor a wheel built by setup.py (which bundles them): a build from a tree
        # without alembic/, or files removed after the install.
        raise MigrationsMissingError(
            f"Factmill's migrations are not beside its code (no {MIGRATIONS / 'env.py'}): reinstall Factmill "
            "from a wheel or source distribution built from its checkout, or from the checkout itself "
            "(`pip install -e .`, as ./dev and deploy/Dockerfile do)"
        )
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["database_url"] = url
    return config


# Told of each migration as it finishes: (revision, seconds it took, the first line of its docstring).
OnStep = Callable[[str, float, str], None]


# A migration waits at most this long for a table's lock (a long query or transaction of the running
# service holds it): while it waited, its ALTER queued every new query of that table behind it, and the
# service stalled with it. It gives up, and the upgrade goes on again from it (the migrations before it
# are committed) a few times, MIGRATION_LOCK_WAIT_SECONDS apart.
MIGRATION_LOCK_TIMEOUT_SECONDS = 5.0
MIGRATION_LOCK_TRIES = 12
MIGRATION_LOCK_WAIT_SECONDS = 5.0


def upgrade(
    url: str,
    revision: str = "head",
    on_step: OnStep | None = None,
    *,
    lock_timeout: float = MIGRATION_LOCK_TIMEOUT_SECONDS,
    tries: int = MIGRATION_LOCK_TRIES,
    wait: float = MIGRATION_LOCK_WAIT_SECONDS,
    down: bool = False,
) -> None:
    """Build or update the schema with the migrations (never create_all); ``on_step`` hears of each
    one as it finishes (each commits on its own: alembic/env.py). A migration that cannot take its
    lock within ``lock_timeout`` seconds, or that Postgres ends to break a deadlock with the running
    service (0016 locks tables in another order than a segment's commit writes them), is tried again, up
    to ``tries`` times in all (each migration is its own transaction: it rolled back whole). With
    ``down``, the migrations after ``revision`` are undone, the same way (`factmill db downgrade`:
    alembic's own command took no lock timeout, and the running service queued behind its ALTERs)."""
    from alembic import command

    config = alembic_config(url)
    config.attributes["on_step"] = on_step
    config.attributes["lock_timeout_ms"] = max(1, round(lock_timeout * 1000))
    tries = max(1, tries)
    for attempt in range(1, tries + 1):
        try:
            (command.downgrade if down else command.upgrade)(config, revision)
            return
        except OperationalError as exc:
            if not (lock_timed_out(exc) or deadlocked(exc)) or attempt == tries:
                raise
            why = (
                f"waited {lock_timeout:g} s for a lock the running service holds"
                if lock_timed_out(exc)
                else "met a deadlock with the running service (Postgres ended it)"
            )
            logger.warning("a migration %s; trying again in %g s (%d of %d)", why, wait, attempt, tries)
            time.sleep(wait)


def pending_revisions(url: str, revision: str = "head") -> list[str]:
    """The migrations an upgrade to ``revision`` would run, oldest first; none for a revision these
    migrations do not have (the upgrade itself then says so)."""
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError

    script = ScriptDirectory.from_config(alembic_config(url))
    current = current_revision(url)
    try:
        steps = list(script.iterate_revisions(revision, current or "base"))
    except RevisionError:
        return []
    return [step.revision for step in reversed(steps) if step.revision != current]


class SchemaState(NamedTuple):
    current: set[str]  # the revisions the database is at
    heads: set[str]  # the head revisions of these migrations
    unknown: set[str]  # of ``current``, those these migrations do not have (a newer Factmill's)

    def problem(self) -> str | None:
        """Why commands cannot use this database yet, with what to do; None when it is at head."""
        if self.unknown:
            return (
                f"the database is at revision {', '.join(sorted(self.unknown))}, newer than this factmill "
                f"knows (its migrations end at {', '.join(sorted(self.heads))}): a newer release upgraded "
                "it; run that release, or downgrade the schema with it (`factmill db downgrade REVISION`)"
            )
        if not self.current:
            return "the database has no Factmill schema; run `factmill db upgrade` first"
        if self.current != self.heads:
            return (
                f"the database is at revision {', '.join(sorted(self.current))}, not "
                f"{', '.join(sorted(self.heads))}; run `factmill db upgrade` first"
            )
        return None


def schema_state(url: str) -> SchemaState:
    """Where the database's schema stands against these migrations."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(alembic_config(url))
    with get_engine(url).connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    unknown = set()
    for revision in current:
        try:
            script.get_revision(revision)
        except CommandError:  # alembic's ResolutionError: no such revision in these migrations
            unknown.add(revision)
    return SchemaState(current, set(script.get_heads()), unknown)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with get_engine(url).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
