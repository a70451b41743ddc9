"""The `factmill` command line: a typer app with one module per command group (see app.py)."""

from __future__ import annotations

from worker.cli.app import app, main

__all__ = ["app", "main"]
