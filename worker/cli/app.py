"""The `factmill` typer app: every command group registered on one app, and `main`."""

from __future__ import annotations

import logging

import typer

from worker.cli.backfill import backfill_app
from worker.cli.calibration import calibration_app
from worker.cli.compaction import compact_command, transcripts_app
from worker.cli.config import config_app
from worker.cli.costs import costs
from worker.cli.db import db_app, db_stop
from worker.cli.demo import demo
from worker.cli.extract import extract
from worker.cli.facts import facts_app
from worker.cli.jobs import jobs_app
from worker.cli.keys import keys_app
from worker.cli.mcp import mcp_command
from worker.cli.pages import ingest, pages_app
from worker.cli.search import embed_command, search_command
from worker.cli.services import beat, flower, serve, worker
from worker.cli.simulator import simulator

app = typer.Typer(
    help="Factmill: turn conversations into durable, trustworthy facts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Registration order is the order `factmill --help` lists them in.
for name, command in (
    ("search", search_command),
    ("embed", embed_command),
    ("compact", compact_command),
    ("ingest", ingest),
    ("extract", extract),
    ("costs", costs),
    ("serve", serve),
    ("worker", worker),
    ("beat", beat),
    ("flower", flower),
    ("simulator", simulator),
    ("demo", demo),
    ("mcp", mcp_command),
    ("down", db_stop),  # the same as `factmill db stop`
):
    app.command(name)(command)
for name, group in (
    ("db", db_app),
    ("config", config_app),
    ("facts", facts_app),
    ("jobs", jobs_app),
    ("keys", keys_app),
    ("pages", pages_app),
    ("calibration", calibration_app),
    ("transcripts", transcripts_app),
    ("backfill", backfill_app),
):
    app.add_typer(group, name=name)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
