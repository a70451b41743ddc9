"""Sessions for commands: the configured database, refused with a clear message until it is migrated."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.cli.console import fail
from worker.settings import Settings, get_settings


def database_url(settings: Settings) -> str:
    """The configured database URL (starting the embedded server if that is the default)."""
    try:
        return db.database_url(settings)
    except Exception as exc:
        raise fail(str(exc)) from exc


def checked_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    """Sessions on the configured database once its schema is at the migrations' head."""
    url = database_url(settings or get_settings())
    problem = db.schema_state(url).problem()
    if problem:
        raise fail(problem)
    return db.session_factory(url)
