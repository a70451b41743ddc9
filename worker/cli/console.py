"""The CLI's one stdout console and one stderr console, the `fail` exit, and JSON output helpers."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from worker.core.jsonvalues import BIGINT_MAX
from worker.core.labels import check_new_source_id, check_source_id
from worker.core.moments import as_utc

# What a terminal acts on instead of showing: C0 controls but tab and newline (ESC opens the sequences
# that clear the screen, move the cursor over earlier lines, set the title or the clipboard; CR
# overwrites a line), DEL, C1 controls (U+009B is CSI to a terminal that reads 8-bit controls), and the
# bidirectional controls that reorder what follows them on screen (the "Trojan Source" characters).
_UNSHOWABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with each character a terminal would act on written as its escape (``\\x1b``,
    ``\\u202e``), so the reader sees what is stored and the terminal does nothing it says."""
    return _UNSHOWABLE.sub(_escape, text)


class TerminalConsole(Console):
    """A Rich console that shows every string as it is: no markup, no emoji codes, and the characters
    a terminal would act on escaped (``visible``). What the CLI prints is mostly stored text that a
    webhook sender or a model chose (source ids, titles, facts, snippets, job errors): read as markup,
    ``[/quote]`` in a snippet ended the command with a traceback, ``[x]`` vanished, ``:smile:`` turned
    into an emoji, and ESC sequences reached the operator's terminal. Style goes on ``styled`` parts.

    Soft wrap: messages are sentences (paths, reasons) that people copy and tests match; Rich must not
    break them mid-phrase at its guess of the width, the terminal wraps them."""

    def __init__(self, *, stderr: bool = False) -> None:
        super().__init__(stderr=stderr, soft_wrap=True, markup=False, emoji=False)

    def render_str(self, text: str, **options: Any) -> Text:
        # Every str Rich prints or puts in a table cell comes through here; no call may turn markup on.
        options.update(markup=False, emoji=False)
        return super().render_str(visible(text), **options)


def styled(*parts: str | tuple[str, str]) -> Text:
    """A line of plain parts and ``(text, style)`` parts, each shown as it is (see ``TerminalConsole``):
    ``styled(("skipped", "yellow"), f" {path}: {reason}")``."""
    return Text.assemble(*(visible(p) if isinstance(p, str) else (visible(p[0]), p[1]) for p in parts))


out = TerminalConsole()
err = TerminalConsole(stderr=True)


def id_argument(help: str) -> Any:
    """A row id: 1 up to Postgres's bigint, anything else a usage error (not the database's
    "bigint out of range" traceback)."""
    return typer.Argument(min=1, max=BIGINT_MAX, help=help)


def port_option(*names: str, help: str, **extra: Any) -> Any:
    """A TCP port option: 1 to 65535, anything else a usage error (not a socket error's traceback)."""
    return typer.Option(*names, min=1, max=65535, help=help, **extra)


def _checked(rule: Callable[[str], str]) -> Callable[[str | None], str | None]:
    def callback(value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return rule(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    return callback


def source_option(*names: str, help: str) -> Any:
    """A source id option naming a source: the rule any stored page's source meets, anything else a
    usage error (a source no page can have would otherwise find nothing without saying why)."""
    return typer.Option(*names, help=help, callback=_checked(check_source_id))


def new_source_option(*names: str, help: str) -> Any:
    """A source id option to store pages under (``check_new_source_id``): refused before any file is read."""
    return typer.Option(*names, help=help, callback=_checked(check_new_source_id))


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
    """A progress bar on stderr (gone when done); yields the function that moves it: one step a call, or
    to ``completed`` of ``total`` when they are given. Disabled (``--json``), or stderr not a terminal (a
    script's log stays clean), the function does nothing."""
    if not enabled or not err.is_terminal:
        yield lambda *_, **__: None
        return
    columns = (
        TextColumn("{task.description}", markup=False),  # the text itself is never a format string
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(visible(description), total=total)

        def move(*_: object, completed: int | None = None, total: int | None = None) -> None:
            if completed is None:
                progress.advance(task)
            else:
                progress.update(task, completed=completed, total=total)

        yield move


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every address)
        return False


def fail(message: str, code: int = 1, *, highlight: bool | None = None) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise: ``raise fail(...)``."""
    err.print(styled(("error:", "bold red"), f" {message}"), highlight=highlight)
    return typer.Exit(code)


def print_json(data: Any, *, ensure_ascii: bool = True) -> None:
    """Write ``data`` as indented JSON on stdout, untouched by Rich (no wrapping, no colour). JSON escapes
    C0 controls itself; without ``ensure_ascii`` the other characters a terminal acts on are written as
    ``\\uXXXX`` escapes too (still the same JSON)."""
    # A stdout that is not UTF-8 (a Latin-1 terminal or pipe) gets ASCII JSON: the same data, escaped.
    utf8 = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "") == "utf8"
    text = json.dumps(data, indent=2, ensure_ascii=ensure_ascii or not utf8)
    sys.stdout.write(_UNSHOWABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")


def _interactive() -> bool:
    """Someone may answer: a terminal on stdin, outside CI (a CI step run in a pseudo-terminal, as
    Buildkite runs them, or `docker run -t`, waited for an answer until the job timed out)."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return sys.stdin.isatty() and not ci


def _stderr_seen() -> bool:
    """Whether a question on stderr may reach the terminal: stderr is one, or a pipe (`2>&1 | tee log`);
    not a file or /dev/null."""
    try:
        return sys.stderr.isatty() or stat.S_ISFIFO(os.fstat(sys.stderr.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):  # a stream with no descriptor (a test runner's)
        return False


def confirmed(question: str, yes: bool, *, script_needs_yes: bool = False) -> bool:
    """Whether a destructive command may go on: ``--yes``, or not at a terminal (a script or a pipe:
    as before; with ``script_needs_yes``, a usage error instead), or the person at the terminal says so
    (the default is no). At a terminal whose stderr is redirected, the question would go to the file
    while the command waited, silent: it is refused, saying to pass --yes."""
    if yes:
        return True
    if not _interactive():
        if script_needs_yes:
            raise fail("this asks first at a terminal; with no terminal, pass --yes", code=2)
        return True
    if not _stderr_seen():
        raise fail(
            "this asks first, but stderr goes to a file (the question would go unseen); pass --yes",
            code=2,
        )
    return typer.confirm(question, default=False, err=True)


YES_OPTION_HELP = "Do not ask first (at a terminal the command asks; a script is never asked)."


def iso_moment(value: str) -> datetime:
    """An option's ISO 8601 date or time ("2026-03-01", "2026-03-01T12:00Z", "...+02:00"), in UTC when
    it names no zone; a usage error (exit 2) otherwise. Typer's own datetime type took three formats
    and no zone, so "--as-of 2024-03-01T12:00:00Z", which the API takes, was refused."""
    try:
        return as_utc(datetime.fromisoformat(value))
    except ValueError:
        raise typer.BadParameter(
            f"expected an ISO date or time such as 2026-03-01 or 2026-03-01T12:00Z, got {value!r}"
        ) from None


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
