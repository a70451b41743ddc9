"""Database engine, sessions and migrations, resolved from Settings (server URL or embedded)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from worker.embedded import embedded_postgres_url, to_sqlalchemy_url
from worker.settings import Settings, get_settings

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = REPO_ROOT / "alembic.ini"


def database_url(settings: Settings | None = None) -> str:
    """The SQLAlchemy URL to use: FACTMILL_DATABASE_URL, else the embedded Postgres."""
    settings = settings or get_settings()
    if settings.database_url:
        return to_sqlalchemy_url(settings.database_url)
    return embedded_postgres_url(settings.data_dir)


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One pooled engine per URL per process."""
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=70, future=True)


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

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(REPO_ROOT / "alembic"))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Build or update the schema with the migrations (never create_all)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def schema_state(url: str) -> tuple[set[str], set[str]]:
    """(revisions the database is at, head revisions of the migrations)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    with get_engine(url).connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    return current, heads


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with get_engine(url).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
