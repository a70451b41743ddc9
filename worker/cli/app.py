"""The `factmill` typer app: every command group registered on one app, and `main`.

Each command is named here by the module that defines it and loaded when it runs: a command module
brings in the services it drives (SQLAlchemy, Celery, the extraction and backfill packages), about a
second and a half of imports on a 2-core machine, so `factmill jobs list` should not also pay for
`factmill backfill`'s. `factmill --help` lists every command and so loads them all.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import typer
import typer.main
from typer.core import TyperGroup


class CommandEntry(NamedTuple):
    """A command (a function) or a command group (a ``typer.Typer``), by module and attribute."""

    name: str
    module: str
    attribute: str


# The order is the order `factmill --help` lists them in.
COMMANDS = (
    CommandEntry("search", "worker.cli.search", "search_command"),
    CommandEntry("embed", "worker.cli.search", "embed_command"),
    CommandEntry("compact", "worker.cli.compaction", "compact_command"),
    CommandEntry("ingest", "worker.cli.pages", "ingest"),
    CommandEntry("extract", "worker.cli.extract", "extract"),
    CommandEntry("costs", "worker.cli.costs", "costs"),
    CommandEntry("serve", "worker.cli.services", "serve"),
    CommandEntry("worker", "worker.cli.services", "worker"),
    CommandEntry("beat", "worker.cli.services", "beat"),
    CommandEntry("flower", "worker.cli.services", "flower"),
    CommandEntry("simulator", "worker.cli.simulator", "simulator"),
    CommandEntry("demo", "worker.cli.demo", "demo"),
    CommandEntry("mcp", "worker.cli.mcp", "mcp_command"),
    CommandEntry("down", "worker.cli.db", "db_stop"),  # the same as `factmill db stop`
    CommandEntry("db", "worker.cli.db", "db_app"),
    CommandEntry("config", "worker.cli.config", "config_app"),
    CommandEntry("facts", "worker.cli.facts", "facts_app"),
    CommandEntry("jobs", "worker.cli.jobs", "jobs_app"),
    CommandEntry("keys", "worker.cli.keys", "keys_app"),
    CommandEntry("pages", "worker.cli.pages", "pages_app"),
    CommandEntry("calibration", "worker.cli.calibration", "calibration_app"),
    CommandEntry("transcripts", "worker.cli.compaction", "transcripts_app"),
    CommandEntry("backfill", "worker.cli.backfill", "backfill_app"),
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

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)


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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
