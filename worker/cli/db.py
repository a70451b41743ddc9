"""`factmill db`: build or show the schema, and stop the embedded Postgres and Redis."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from worker import db
from worker.cli.console import confirmed, err, fail, out
from worker.cli.sessions import database_url, describe_database, refuse_unset_servers, schema_state
from worker.core.errors import error_summary
from worker.embedded import StopOutcome, stop_embedded_postgres, stop_embedded_redis
from worker.settings import Settings, get_settings

db_app = typer.Typer(help="Database schema and the embedded servers.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(
    revision: str = "head",
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait for a database that is unreachable or starting (FACTMILL_STARTUP_WAIT_SECONDS), "
            "as a deployment's migrate step should.",
        ),
    ] = False,
) -> None:
    """Build or update the schema with the migrations."""
    settings = get_settings()
    refuse_unset_servers(settings, "database_url")  # a migrate Job migrated a throwaway embedded Postgres
    url = database_url(settings)
    try:
        upgrade_schema(settings, url, revision, wait=wait)
    except SchemaUpgradeError as exc:
        raise fail(str(exc), code=exc.code) from None
    out.print(f"schema at revision {db.current_revision(url)} ({describe_database(settings)})")


class SchemaUpgradeError(Exception):
    """The schema could not be brought to the revision; the message says why and where it stays."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def upgrade_schema(
    settings: Settings, url: str, revision: str = "head", *, wait: bool = False, quiet: bool = False
) -> None:
    """Run the migrations up to ``revision``, saying on stderr what it sets out to run and each step
    (unless ``quiet``: the demo's own database, built from nothing, 39 lines of it);
    SchemaUpgradeError with one line for a person (`db upgrade` and the demo: the demo's own upgrade
    was a traceback for a schema a newer release made, a refused migration or a table lock held)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    state = schema_state(settings, url, wait=wait)
    if state.unknown:  # upgraded by a newer release: alembic would only say it cannot find the revision
        raise SchemaUpgradeError(str(state.problem()))
    try:
        pending = db.pending_revisions(url, revision)
        if pending and not quiet:  # a migration over a large table can take minutes: say where it stands
            err.print(f"upgrading the schema: {len(pending)} migration(s), {pending[0]} to {pending[-1]}")
        db.upgrade(url, revision, on_step=None if quiet else _report_step)
    except CommandError as exc:  # a revision that is not one of the migrations'
        raise SchemaUpgradeError(f"cannot upgrade to {revision!r}: {exc}", code=2) from None
    except DBAPIError as exc:  # each migration commits on its own (alembic/env.py): the failed one did not
        stays = db.current_revision(url) or "no schema"
        raise SchemaUpgradeError(
            f"the upgrade failed, its last migration rolled back (the schema stays at {stays}; run it "
            f"again to go on from there): {error_summary(exc)}"
        ) from None
    except db.MigrationRefusedError as exc:  # what to do is its message
        raise SchemaUpgradeError(
            f"{exc} (the schema stays at {db.current_revision(url) or 'no schema'})"
        ) from None


def _report_step(revision: str, seconds: float, doc: str) -> None:
    err.print(f"  {revision} ran in {seconds:.1f} s: {doc}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="The revision to go back to (e.g. 0048).")],
    yes: Annotated[
        bool, typer.Option("--yes", help="Do not ask first (at a terminal it asks; a script must pass it).")
    ] = False,
) -> None:
    """Undo the migrations after REVISION, as the release being rolled back to expects.

    With `db upgrade`'s lock timeout and retries (alembic's own command had none: the running service
    queued behind its ALTERs). What a migration added is dropped with its data; a few refuse while they
    hold what cannot be rebuilt, saying what to do first. Asks first; a script passes --yes."""
    settings = get_settings()
    refuse_unset_servers(settings, "database_url")
    url = database_url(settings)
    current = db.current_revision(url) or "no schema"
    question = f"Downgrade the schema from {current} to {revision}? A column dropped is gone."
    if not confirmed(question, yes, script_needs_yes=True):  # (a script that forgot it dropped tables)
        raise fail("nothing was downgraded")
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    try:
        db.upgrade(url, revision, on_step=_report_step, down=True)
    except CommandError as exc:  # not one of the migrations' revisions (or one ahead of the schema)
        raise fail(f"cannot downgrade to {revision!r}: {exc}", code=2) from None
    except (DBAPIError, RuntimeError) as exc:  # a migration's refusal says what to do first
        said = error_summary(exc) if isinstance(exc, DBAPIError) else str(exc)
        stays = db.current_revision(url) or "no schema"
        raise fail(f"the downgrade stopped (the schema stays at {stays}): {said}") from None
    out.print(f"schema at revision {db.current_revision(url) or 'no schema'} ({describe_database(settings)})")


@db_app.command("current")
def db_current() -> None:
    """Show the schema revision."""
    out.print(db.current_revision(database_url(get_settings())) or "no schema")


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded Postgres and Redis, and wait until they have exited.

    They keep running between commands otherwise. Exits 1 if one is still running."""
    settings = get_settings()
    outcomes: list[StopOutcome] = []
    if not settings.database_url:
        outcomes.append(stop_embedded_postgres(settings.data_dir))
    if not settings.broker_url:
        outcomes.append(stop_embedded_redis(settings.data_dir))
    if not outcomes:
        raise fail(
            "FACTMILL_DATABASE_URL and FACTMILL_BROKER_URL are set; there is no embedded server to stop"
        )
    for outcome in outcomes:
        if outcome.state == "not running" and not outcome.detail:
            # Where it looked: the data folder is ./var by default, and `down` run from another folder
            # than the demo's said "not running" while the servers ran on.
            outcome = replace(outcome, detail=f"in {settings.data_dir.resolve()}")
        (err if outcome.state == "still running" else out).print(outcome.describe(), highlight=False)
    if any(outcome.state == "still running" for outcome in outcomes):
        raise typer.Exit(1)
