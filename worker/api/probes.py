"""Whether this API process reaches its stores: the checks behind /readyz and factmill_broker_up."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import redis
from kombu import Connection
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from models.reads import read_only
from worker.api.errors import one_line
from worker.core.redis_urls import is_redis_url, redis_py_url

logger = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 2.0


def ping_database(factory: sessionmaker[Session]) -> None:
    with read_only(factory) as session:
        session.execute(text("SELECT 1"))


def ping_broker(url: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    """Raise unless the broker answers within ``timeout`` seconds."""
    if is_redis_url(url):
        client = redis.Redis.from_url(
            redis_py_url(url), socket_timeout=timeout, socket_connect_timeout=timeout
        )
        try:
            client.ping()
        finally:
            client.close()
        return
    with Connection(url, connect_timeout=timeout) as conn:
        conn.ensure_connection(max_retries=1)


class BrokerCollector:
    """``factmill_broker_up``: 1 if this replica reaches the broker at scrape time. Without the broker
    the API still stores pages and their jobs (the sweeper sends them once it is back), so /readyz stays
    200 and says "degraded": this gauge is how Prometheus learns of the outage."""

    def __init__(self, ping: Callable[[], None]) -> None:
        self.ping = ping

    def collect(self) -> Iterator[Metric]:
        try:
            self.ping()
            up = 1
        except Exception as exc:
            logger.warning("metrics: the broker is unreachable (%s)", one_line(exc))
            up = 0
        yield GaugeMetricFamily("factmill_broker_up", "1 if this API replica reaches the broker", value=up)


__all__ = ["READY_TIMEOUT_SECONDS", "BrokerCollector", "ping_broker", "ping_database", "redis_py_url"]
