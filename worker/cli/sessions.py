"""Sessions for commands: the configured database, refused with a clear message until it is migrated."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_exponential

from worker import db
from worker.cli.console import err, fail
from worker.core.errors import InvalidSettingsError, connection_failure, error_summary
from worker.settings import RefusedSettingsError, Settings, get_settings


def database_url(settings: Settings) -> str:
    """The configured database URL (starting the embedded server if that is the default; refused in
    production, where a command run without FACTMILL_DATABASE_URL changed a throwaway database)."""
    refuse_unset_servers(settings, "database_url")
    try:
        return db.database_url(settings)
    except InvalidSettingsError:
        raise  # one line and exit 2, as every refused setting (worker.cli.app.main)
    except Exception as exc:
        raise fail(str(exc)) from exc


def _say_waiting(state: RetryCallState) -> None:
    # Said once (a line a retry is noise); only exceptions are retried, so the outcome holds one.
    exc = state.outcome.exception() if state.outcome is not None else None
    if state.attempt_number == 1 and exc is not None:
        reason = connection_failure(exc) or error_summary(exc)
        err.print(f"the database is unavailable ({reason}); waiting for it", highlight=False)


def schema_state(settings: Settings, url: str, *, wait: bool = False) -> db.SchemaState:
    """The database's schema revision. ``wait`` (a service's start, the migrate step of a deployment):
    a database that is unreachable or restarting is waited for, up to FACTMILL_STARTUP_WAIT_SECONDS,
    as Celery waits for its broker; a worker started during a failover then comes up with the database
    instead of exiting (and, on Kubernetes, backing off for minutes). A command an operator types
    fails at once."""
    retrying = Retrying(
        retry=retry_if_exception(db.database_unavailable),
        stop=stop_after_delay(settings.startup_wait_seconds if wait else 0),
        wait=wait_exponential(multiplier=0.5, max=5),
        before_sleep=_say_waiting,
        reraise=True,
    )
    return retrying(db.schema_state, url)


def describe_database(settings: Settings) -> str:
    if settings.database_url:
        return "Postgres: FACTMILL_DATABASE_URL"
    return f"Postgres: embedded (pgserver) under {(settings.data_dir / 'pg').resolve()}"


def checked_factory(settings: Settings | None = None, *, wait: bool = False) -> sessionmaker[Session]:
    """Sessions on the configured database once its schema is at the migrations' head (``wait``: see
    ``schema_state``)."""
    settings = settings or get_settings()
    url = database_url(settings)
    problem = schema_state(settings, url, wait=wait).problem()
    if problem and not settings.database_url:
        # Which one: run from another folder, ./var named a new, empty one, and "run `factmill db
        # upgrade`" built a second database beside the one the service uses.
        problem += f" ({describe_database(settings)}; FACTMILL_DATA_DIR names the folder)"
    if problem:
        raise fail(problem)
    return db.session_factory(url)


def refuse_unset_servers(settings: Settings, *names: str) -> None:
    """Settings.require_servers as one line and exit 2 (a command that needs only these servers)."""
    try:
        settings.require_servers(*names)
    except RefusedSettingsError as exc:
        raise fail(str(exc), code=2) from None


def embedded_broker_note(settings: Settings) -> str | None:
    """What to say where the database is a server's but the broker is the embedded Redis of this data
    folder: only the processes run with the same folder read its jobs (a command run from another
    folder queued them where no worker looked: run only when the sweeper took them for lost)."""
    if not settings.database_url or settings.broker_url or settings.data_dir.is_absolute():
        return None  # (an absolute data folder: shared on purpose, as README says to)
    return (
        "FACTMILL_DATABASE_URL is set but FACTMILL_BROKER_URL is not: jobs go through the embedded Redis "
        f"under {settings.data_dir.resolve()}, which only processes run from this folder read; set "
        "FACTMILL_BROKER_URL to the workers' broker (or FACTMILL_DATA_DIR to the workers' data folder, an "
        "absolute path)"
    )


def say_where_jobs_go(settings: Settings) -> None:
    """``embedded_broker_note`` on stderr, where there is one."""
    note = embedded_broker_note(settings)
    if note is not None:
        err.print(f"note: {note}", highlight=False)
