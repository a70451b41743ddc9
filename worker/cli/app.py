"""The `factmill` typer app: every command group registered on one app, and `main`.

Each command is named here by the module that defines it and loaded when it runs: a command module
brings in the services it drives (SQLAlchemy, Celery, the extraction and backfill packages), about a
second and a half of imports on a 2-core machine, so `factmill jobs list` should not also pay for
`factmill backfill`'s. `factmill --help` lists every command by the summary written beside it here,
and so loads none of them (a test holds each summary to its command's help).
"""

from __future__ import annotations

import errno
import importlib
import io
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from worker.core.errors import (
    EmbeddedUnavailableError,
    InvalidSettingsError,
    LLMConfigurationError,
    LoggableArguments,
    MigrationsMissingError,
    RefusedSettingsError,
    connection_failure,
    database_outage,
)


class CommandEntry(NamedTuple):
    """A command (a function) or a command group (a ``typer.Typer``), by module and attribute, with
    the first paragraph of its help (what `factmill --help` lists)."""

    name: str
    module: str
    attribute: str
    summary: str


# The order is the order `factmill --help` lists them in.
COMMANDS = (
    CommandEntry(
        "search",
        "worker.cli.search",
        "search_command",
        "Search the facts: lexical, vector and LLM-expanded, fused, with intent-aware snippets.",
    ),
    CommandEntry(
        "embed",
        "worker.cli.search",
        "embed_command",
        "Embed every fact that has no embedding yet (and set up the pgvector store when the server has it).",
    ),
    CommandEntry(
        "compact",
        "worker.cli.compaction",
        "compact_command",
        "Force a compaction of TRANSCRIPT_ID, even under its threshold: queue a job, or run it --now.",
    ),
    CommandEntry(
        "ingest",
        "worker.cli.pages",
        "ingest",
        "Store page files (front matter: slug, type, title); queue an extraction job per changed page.",
    ),
    CommandEntry(
        "extract",
        "worker.cli.extract",
        "extract",
        "Extract facts from conversation pages, resuming where the last run stopped.",
    ),
    CommandEntry(
        "costs",
        "worker.cli.costs",
        "costs",
        "LLM spend from llm_calls: calls, tokens, the cached share of input tokens, and USD.",
    ),
    CommandEntry(
        "serve",
        "worker.cli.services",
        "serve",
        "Run the HTTP API (webhooks, jobs, facts, config, health, metrics).",
    ),
    CommandEntry(
        "worker",
        "worker.cli.services",
        "worker",
        "Run Celery workers for the given queues: one process per core unless --processes says otherwise.",
    ),
    CommandEntry(
        "beat",
        "worker.cli.services",
        "beat",
        "Run Celery beat (the sweeper every 30 s, and later schedules).",
    ),
    CommandEntry(
        "flower",
        "worker.cli.services",
        "flower",
        "Run Flower on the same broker to watch workers, queues and tasks.",
    ),
    CommandEntry(
        "simulator",
        "worker.cli.simulator",
        "simulator",
        "Run the LLM simulator (OpenAI and Anthropic wire formats; not a real model).",
    ),
    CommandEntry(
        "demo",
        "worker.cli.demo",
        "demo",
        "Boot the service on the embedded default and run the examples through it.",
    ),
    CommandEntry(
        "mcp",
        "worker.cli.mcp",
        "mcp_command",
        "Serve the facts and transcripts as MCP tools: stdio by default, or streamable HTTP with --http.",
    ),
    CommandEntry(
        "down",
        "worker.cli.db",
        "db_stop",
        "Stop the embedded Postgres and Redis, and wait until they have exited.",
    ),  # the same as `factmill db stop`
    CommandEntry(
        "db",
        "worker.cli.db",
        "db_app",
        "Database schema and the embedded servers.",
    ),
    CommandEntry(
        "config",
        "worker.cli.config",
        "config_app",
        "Runtime configuration: kill switches and tunables.",
    ),
    CommandEntry(
        "facts",
        "worker.cli.facts",
        "facts_app",
        "Read extracted facts.",
    ),
    CommandEntry(
        "jobs",
        "worker.cli.jobs",
        "jobs_app",
        "Jobs: the outbox and its history.",
    ),
    CommandEntry(
        "keys",
        "worker.cli.keys",
        "keys_app",
        "API keys: who may read, ingest or administer.",
    ),
    CommandEntry(
        "pages",
        "worker.cli.pages",
        "pages_app",
        "Stored pages: list them, erase one.",
    ),
    CommandEntry(
        "calibration",
        "worker.cli.calibration",
        "calibration_app",
        "Calibration of the summary quality gate: observations, thresholds, history, plot.",
    ),
    CommandEntry(
        "transcripts",
        "worker.cli.compaction",
        "transcripts_app",
        "Agent transcripts: settings, tokens before/after compaction, compactions.",
    ),
    CommandEntry(
        "backfill",
        "worker.cli.backfill",
        "backfill_app",
        "Backfills: pending segments of many pages through provider batches (half price), on the queue.",
    ),
)
_BY_NAME = {entry.name: entry for entry in COMMANDS}


def load_command(entry: CommandEntry) -> Any:
    """Import the entry's module and build its click command as typer builds a registered one."""
    target: Any = getattr(importlib.import_module(entry.module), entry.attribute)
    holder = typer.Typer()
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=entry.name)
    else:
        holder.command(entry.name)(target)
    return typer.main.get_group(holder).commands[entry.name]


class _CommandsByName(MutableMapping[str, Any]):
    """COMMANDS by name, each loaded the first time it is looked up; its names listed without loading."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            self._loaded[name] = load_command(_BY_NAME[name])  # KeyError: no such command
        return self._loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*_BY_NAME, *(name for name in self._loaded if name not in _BY_NAME)])

    def __len__(self) -> int:
        return len(_BY_NAME.keys() | self._loaded.keys())

    def __contains__(self, name: object) -> bool:
        return name in _BY_NAME or name in self._loaded


class LazyCommands(TyperGroup):
    """The root group: its commands are COMMANDS, each loaded only when it is asked for (a typo is
    still answered with the names it is close to). Contexts and commands are typed Any: recent typer
    versions build on a click of their own, older ones on click."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _CommandsByName()
        self._listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        entry = _BY_NAME.get(cmd_name)
        if self._listing and entry is not None:
            # Listed in the help: a stand-in with the summary, so the listing loads no command module.
            return TyperCommand(name=cmd_name, help=entry.summary)
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyCommands,
    help="Factmill: turn conversations into durable, trustworthy facts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    # A callback makes typer build the root as a group (LazyCommands) though nothing is registered on it.
    pass


def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        # A terminal or pipe that is not UTF-8 (LC_ALL=de_DE.ISO-8859-1): a character it cannot take
        # ("…", "→", a page's name) is written escaped. Strict, it was a traceback, after the command
        # had committed (`keys revoke` revoked the key, then said it failed).
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # the services' rule for exceptions logged as arguments
        handler.addFilter(LoggableArguments())
    undecodable = _undecodable_argument(sys.argv[1:])
    if undecodable is not None:
        _error(undecodable)
        raise SystemExit(2)
    try:
        app()
    except (InvalidSettingsError, RefusedSettingsError) as exc:  # one line, exit 2: a setting to fix
        _error(str(exc))
        raise SystemExit(2) from None
    except MigrationsMissingError as exc:  # installed from a wheel: no command can check the schema
        _error(str(exc))
        raise SystemExit(1) from None
    except LLMConfigurationError as exc:  # no key for the provider chosen, or none in production
        _error(str(exc))
        raise SystemExit(2) from None
    except EmbeddedUnavailableError as exc:  # raised where Celery resolves the broker, or in the demo
        _error(str(exc))
        raise SystemExit(1) from None
    except OSError as exc:  # a data folder that cannot be written, a port another process holds
        reason = os_failure(exc)
        if reason is None:
            raise
        _error(reason)
        raise SystemExit(1) from None
    except Exception as exc:  # the database cannot be reached: one line, exit 1, whatever the command
        reason = connection_failure(exc)
        if reason is not None:
            _error(f"cannot reach the database: {reason} (is it running? FACTMILL_DATABASE_URL names it)")
            raise SystemExit(1) from None
        outage = database_outage(exc)  # it went away (or filled up) once the command had begun
        if outage is None:
            raise
        _error(
            f"the database failed during the command: {outage}; "
            "what it committed stays: check, then run it again"
        )
        raise SystemExit(1) from None


def os_failure(exc: OSError) -> str | None:
    """One line for an OSError a user can act on (a path, an address in use); None for any other."""
    if exc.filename is not None:
        return f"cannot use {exc.filename}: {exc.strerror or exc}"
    if exc.errno == errno.EADDRINUSE:
        return f"{exc.strerror or exc}: another process listens there; choose another --port"
    return None


# Commands whose arguments may name files: a file named in another encoding is still that file (open()
# takes its bytes back), and the command says per file what it could not use of it.
PATH_COMMANDS = (("ingest",), ("demo",), ("calibration", "import"), ("calibration", "show"))


def _undecodable_argument(arguments: list[str]) -> str | None:
    """Why an argument cannot be used, or None: Python keeps bytes that are not text in the locale's
    encoding as lone surrogates, which no query can send (a UnicodeEncodeError traceback, as
    `factmill pages erase default $'caf\\xe9'` gave in a Latin-1 terminal). An existing file's name given
    to a command that reads files is left to it."""
    takes_paths = any(tuple(arguments[: len(command)]) == command for command in PATH_COMMANDS)
    for position, argument in enumerate(arguments, start=1):
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            named = argument.split("=", 1)[1] if argument.startswith("-") and "=" in argument else argument
            if takes_paths and os.path.lexists(named):  # a path, or --examples=PATH
                continue
            shown = argument.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
            return (
                f"argument {position} ({shown}) holds bytes that are not UTF-8 text; "
                "set the terminal to UTF-8, or type the name as UTF-8"
                + ("; a file of that name: rename it, or pass its folder" if takes_paths else "")
            )
    return None


def _error(message: str) -> None:
    """``error: message`` on stderr, as console.fail prints it, without loading Rich first."""
    typer.secho("error:", fg="red", bold=True, err=True, nl=False)
    typer.echo(f" {message}", err=True)
