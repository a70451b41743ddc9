"""The factmill CLI in this process, on a test database (it opens its own engine: rows must be committed)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from typer.testing import CliRunner

from worker.cli import app
from worker.cli.app import main
from worker.settings import get_settings


def invoke_cli(database_url: str, *args: str, **env: str) -> Any:
    """``factmill ARGS`` with FACTMILL_DATABASE_URL (and ``env``) set for the call; its click Result."""
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, list(args), env={"FACTMILL_DATABASE_URL": database_url, **env})
    finally:
        get_settings.cache_clear()


@dataclass(frozen=True)
class Ran:
    """What a run of the command left: as ``subprocess.CompletedProcess`` names it."""

    returncode: int
    stdout: str
    stderr: str


def run_main(args: list[str], env: Mapping[str, str]) -> Ran:
    """``factmill ARGS`` as its entry point runs it (``main``: its one-line errors and exit codes), in
    this process, with exactly ``env``'s FACTMILL_ variables (this process's others stay). A process of
    its own costs a second or two of CPU to import the command; the suite ran a few hundred.

    The root logger is the command's own meanwhile, as in a process: ``main`` configures it (a handler
    on this stderr, with the services' filter), so its log lines are in ``stderr``; pytest's handlers
    are put back after, without the filter (it rewrote every later test's records)."""
    runner = CliRunner()
    unset: dict[str, str | None] = {key: None for key in os.environ if key.startswith("FACTMILL_")}
    ours = {key: value for key, value in env.items() if key.startswith("FACTMILL_")}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    get_settings.cache_clear()
    argv, code = sys.argv, 0
    with runner.isolation(env={**unset, **ours}) as (out, err, _):
        sys.argv = ["factmill", *args]
        root.handlers = []
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.argv = argv
            get_settings.cache_clear()
            for handler in root.handlers:
                handler.close()
            root.handlers = handlers
            root.setLevel(level)
            sys.stdout.flush()
            sys.stderr.flush()
        return Ran(code, out.getvalue().decode(), err.getvalue().decode())
