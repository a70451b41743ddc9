"""The factmill CLI in this process, on a test database (it opens its own engine: rows must be committed)."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from worker.cli import app
from worker.settings import get_settings


def invoke_cli(database_url: str, *args: str, **env: str) -> Any:
    """``factmill ARGS`` with FACTMILL_DATABASE_URL (and ``env``) set for the call; its click Result."""
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, list(args), env={"FACTMILL_DATABASE_URL": database_url, **env})
    finally:
        get_settings.cache_clear()
