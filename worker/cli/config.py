"""`factmill config`: read and set kill switches and tunables."""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli.console import fail, folding_table, out, styled, when
from worker.cli.sessions import checked_factory
from worker.config_store import (
    UnknownConfigKeyError,
    check_key,
    config_table,
    get_config,
    set_config,
    unset_config,
)
from worker.jobs.outbox import SWEEP_BATCH, resume_for_config_change
from worker.jobs.sending import enqueue

config_app = typer.Typer(help="Runtime configuration: kill switches and tunables.", no_args_is_help=True)


@config_app.command("get")
def config_get(key: str) -> None:
    """Print one config value ("(not set)": the default holds; a kill switch then means on)."""
    try:
        check_key(key)
    except UnknownConfigKeyError as exc:
        raise fail(str(exc), code=2) from exc
    with checked_factory()() as session:
        value = get_config(session, key)
    out.print(value if value is not None else "(not set)")


@config_app.command("set")
def config_set(
    key: str, value: str, by: Annotated[str, typer.Option(help="Who made the change (recorded).")] = "cli"
) -> None:
    """Set a config value; kill switches take effect in running workers within seconds."""
    factory = checked_factory()
    try:
        with factory.begin() as session:
            stored = set_config(session, key, value, updated_by=by)
            resumed = resume_for_config_change(session, key, stored)
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    enqueue(factory, resumed)
    out.print(f"{key} = {stored}" + _resumed_note(resumed))


@config_app.command("unset")
def config_unset(key: str) -> None:
    """Remove a config value, so it means its default again (a kill switch: on)."""
    factory = checked_factory()
    try:
        with factory.begin() as session:
            removed = unset_config(session, key)
            resumed = resume_for_config_change(session, key, None) if removed else []
    except UnknownConfigKeyError as exc:
        raise fail(str(exc), code=2) from exc
    enqueue(factory, resumed)
    if not removed:
        out.print(f"{key} was not set")
        return
    out.print(f"{key} unset" + _resumed_note(resumed))


@config_app.command("list")
def config_list() -> None:
    """Every key workers read, with its value and who set it when (unset: its default).

    Then any set key nothing reads, as GET /v1/config lists them."""
    with checked_factory()() as session:
        rows, unread = config_table(session)
    table = folding_table("key", "value", "updated_by", "updated_at")
    for key, row in rows:
        if row is None:
            table.add_row(key, styled(("(default)", "dim")), "", "")
        else:
            table.add_row(key, row.value, row.updated_by or "", when(row.updated_at))
    out.print(table)
    if unread:
        out.print(
            f"Nothing reads {', '.join(unread)} (set before keys were checked); "
            "remove them with `factmill config unset KEY`."
        )


def _resumed_note(resumed: list[tuple[int, str]]) -> str:
    if not resumed:
        return ""
    rest = "; the sweeper resumes the rest" if len(resumed) >= SWEEP_BATCH else ""
    return f" ({len(resumed)} paused job(s) resumed{rest})"
