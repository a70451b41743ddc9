"""`factmill db`: build or show the schema, and stop the embedded Postgres."""

from __future__ import annotations

import typer

from worker import db
from worker.cli.console import fail, out
from worker.cli.sessions import database_url
from worker.embedded import stop_embedded_postgres
from worker.settings import Settings, get_settings

db_app = typer.Typer(help="Database schema and the embedded server.", no_args_is_help=True)


def _describe_database(settings: Settings) -> str:
    if settings.database_url:
        return "Postgres: FACTMILL_DATABASE_URL"
    return f"Postgres: embedded (pgserver) under {(settings.data_dir / 'pg').resolve()}"


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Build or update the schema with the migrations."""
    settings = get_settings()
    url = database_url(settings)
    db.upgrade(url, revision)
    out.print(f"schema at revision {db.current_revision(url)} ({_describe_database(settings)})")


@db_app.command("current")
def db_current() -> None:
    """Show the schema revision."""
    out.print(db.current_revision(database_url(get_settings())) or "no schema")


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded Postgres (it keeps running between commands otherwise)."""
    settings = get_settings()
    if settings.database_url:
        raise fail("FACTMILL_DATABASE_URL is set; there is no embedded server to stop")
    out.print("stopped" if stop_embedded_postgres(settings.data_dir) else "not running")
