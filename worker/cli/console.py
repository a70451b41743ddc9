"""The CLI's one stdout console and one stderr console, the `fail` exit, and JSON output helpers."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from worker.core.jsonvalues import BIGINT_MAX
from worker.core.labels import check_source_id

# Soft wrap: messages are sentences (paths, reasons) that people copy and tests match; Rich must not
# break them mid-phrase at its guess of the width, the terminal wraps them.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def id_argument(help: str) -> Any:
    """A row id: 1 up to Postgres's bigint, anything else a usage error (not the database's
    "bigint out of range" traceback)."""
    return typer.Argument(min=1, max=BIGINT_MAX, help=help)


def port_option(*names: str, help: str, **extra: Any) -> Any:
    """A TCP port option: 1 to 65535, anything else a usage error (not a socket error's traceback)."""
    return typer.Option(*names, min=1, max=65535, help=help, **extra)


def _source_id(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_source_id(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def source_option(*names: str, help: str) -> Any:
    """A source id option: the rule pages are stored under, anything else a usage error (a source
    no page can have would otherwise find nothing, or store nothing, without saying why)."""
    return typer.Option(*names, help=help, callback=_source_id)


def folding_table(*headers: str, **options: Any) -> Table:
    """A Rich table whose cells fold a long word (a config key, a slug, a timestamp) onto more lines
    instead of cutting it with an ellipsis: people copy those."""
    made = Table(**options)
    for header in headers:
        made.add_column(header, overflow="fold")
    return made


@contextmanager
def counting_bar(
    description: str, total: int | None, *, enabled: bool = True
) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr (gone when done); yields the function that advances it by one. Disabled
    (``--json``), or stderr not a terminal (a script's log stays clean), the function does nothing."""
    if not enabled or not err.is_terminal:
        yield lambda *_: None
        return
    columns = (TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda *_: progress.advance(task)


def fail(message: str, code: int = 1, *, highlight: bool | None = None) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise: ``raise fail(...)``."""
    err.print(f"[bold red]error:[/] {message}", highlight=highlight)
    return typer.Exit(code)


def print_json(data: Any, *, ensure_ascii: bool = True) -> None:
    """Write ``data`` as indented JSON on stdout, untouched by Rich (no wrapping, no colour)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=ensure_ascii) + "\n")


def when(moment: datetime | str | None) -> str:
    """A time as the tables show it: UTC to the minute ("2026-12-04 05:19"), "" for none. An ISO string
    (a JSON report's) is read first; the JSON output keeps the full time."""
    if moment is None:
        return ""
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M")


def fields(row: object, names: Iterable[str]) -> dict[str, Any]:
    """The named attributes of a row, in that order, as JSON values (datetimes in ISO 8601)."""
    return {name: _json_value(getattr(row, name)) for name in names}


def _json_value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value
