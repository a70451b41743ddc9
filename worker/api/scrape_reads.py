"""The collectors that read Postgres when Prometheus scrapes, and what they share within one scrape."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Generic, TypeVar

import psycopg
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from models.reads import one_snapshot
from worker.api.errors import one_line
from worker.core.errors import loggable
from worker.db import database_unavailable, database_went_away, went_away_by_sqlstate

logger = logging.getLogger(__name__)

METRICS_STATEMENT_TIMEOUT = "5s"
# After one collector could not reach Postgres, the others of the scrape (and of scrapes this soon after)
# answer "unreadable" at once: each waited out its own connect timeout, six in a row, and a scrape took
# minutes, far past Prometheus's own timeout, so factmill_store_up 0 never reached it.
OUTAGE_SECONDS = 15.0
# Past OUTAGE_SECONDS, and until this long after the store was last seen away, a scrape asks first with
# a connect of PROBE_CONNECT_SECONDS: at Prometheus's 1-minute default each scrape found the outage
# forgotten, waited out the full connect timeout (10 s) in its key check or first read, and timed out,
# so factmill_store_up 0 was never stored (FactmillStoreDown could not fire).
OUTAGE_MEMORY_SECONDS = 600.0
PROBE_CONNECT_SECONDS = 2
# factory -> when a collector last failed to reach the store through it (weak: a factory's id is reused)
_outages: weakref.WeakKeyDictionary[sessionmaker[Session], float] = weakref.WeakKeyDictionary()
_gone: weakref.WeakKeyDictionary[sessionmaker[Session], float] = weakref.WeakKeyDictionary()  # went away

R = TypeVar("R")


def outage_seen(factory: sessionmaker[Session], *, gone: bool = False) -> bool:
    """Whether a scrape's read (or its key check) failed to reach the store through ``factory`` lately;
    ``gone``: because the database went away (not one out of connections or a busy pool, which is up
    and would say a key was revoked)."""
    seen = (_gone if gone else _outages).get(factory)
    return seen is not None and time.monotonic() - seen < OUTAGE_SECONDS


def outage_persists(factory: sessionmaker[Session], *, gone: bool = False) -> bool:
    """``outage_seen``, or an outage seen within OUTAGE_MEMORY_SECONDS that a quick connect finds still
    there (noted again: the rest of the scrape answers at once); a store that answers it is forgotten
    as away."""
    if outage_seen(factory, gone=gone):
        return True
    seen = (_gone if gone else _outages).get(factory)
    if seen is None or time.monotonic() - seen >= OUTAGE_MEMORY_SECONDS:
        return False
    away = store_away(factory)
    if away is None:
        _outages.pop(factory, None)
        _gone.pop(factory, None)
    if not away:
        # Up (answering, or refusing a new connection: out of connections, when the pool's own may still
        # read, and a collector that cannot says so): the reads go ahead.
        return False
    note_outage(factory, gone=True)
    return True


def store_away(factory: sessionmaker[Session]) -> bool | None:
    """None when a new connection to the factory's database opens within PROBE_CONNECT_SECONDS; else
    whether the database is gone (``database_went_away``) rather than up and refusing. Connected with
    the arguments the engine's own connections get from its URL (a URL written back out lost a space
    in a password or an option, and several hosts)."""
    engine = factory.kw["bind"].engine
    args, params = engine.dialect.create_connect_args(engine.url)
    params.pop("context", None)  # (the dialect's adapters: not a connection parameter)
    try:
        psycopg.connect(*args, **{**params, "connect_timeout": PROBE_CONNECT_SECONDS}).close()
    except psycopg.Error as exc:
        return went_away_by_sqlstate(exc.sqlstate)
    return None


def note_outage(factory: sessionmaker[Session], *, gone: bool) -> None:
    _outages[factory] = time.monotonic()
    if gone:
        _gone[factory] = _outages[factory]


class ScrapeTimeCollector(Generic[R]):
    """A Prometheus collector that reads Postgres at scrape time, under a statement timeout.

    Postgres is the source of truth, so the numbers are the same whichever API replica is
    scraped and survive restarts; there is no in-process counter to keep in step.
    """

    reads = "the store"  # for the warning when the read fails
    # Its figures unbuilt are said by a series of its own (factmill_metrics_unbuilt, an alert of its own),
    # not counted unread too: one fault fired two alerts.
    says_unbuilt = False

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._scrape = threading.local()

    def describe(self) -> list[Metric]:
        return []  # keeps registration from querying the database

    @property
    def failed(self) -> bool:
        """This thread's scrape could not read or build this collector's figures (MissingReadsCollector,
        registered after it: a scrape collects on one thread). Kept per thread: shared, two scrapes at
        once (two Prometheus servers) read each other's."""
        return bool(getattr(self._scrape, "failed", False))

    def collect(self) -> list[Metric]:
        metrics, self._scrape.failed = self._collected()
        return metrics

    def _collected(self) -> tuple[list[Metric], bool]:
        """(what the scrape answers, whether the figures could not be read or built)."""
        if outage_persists(self.factory):
            return self.unreadable(), True
        try:
            # One snapshot: the call totals and the latency buckets (jobs and paused jobs) are read by
            # separate statements, and calls committed between them made a bucket exceed its +Inf.
            with one_snapshot(self.factory) as session:
                session.execute(text(f"SET LOCAL statement_timeout = '{METRICS_STATEMENT_TIMEOUT}'"))
                rows = self.read(session)
        except Exception as exc:
            logger.warning("metrics: could not read %s: %s", self.reads, one_line(exc))
            if not database_unavailable(exc):  # a query's own failure (a timeout, a deadlock): it answered
                return self.unanswered(), True
            note_outage(self.factory, gone=isinstance(exc, OperationalError) and database_went_away(exc))
            return self.unreadable(), True
        try:
            return self.metrics(rows), False
        except Exception as exc:  # read, but not built (stored buckets that no longer match the code's)
            logger.error("metrics: could not build %s from what was read (%s)", self.reads, loggable(exc))
            return self.unbuildable(), not self.says_unbuilt

    def read(self, session: Session) -> R:
        raise NotImplementedError

    def metrics(self, rows: R) -> list[Metric]:
        raise NotImplementedError

    def unreadable(self) -> list[Metric]:
        """What a scrape answers when the store could not be reached."""
        return []

    def unanswered(self) -> list[Metric]:
        """What a scrape answers when the store was reached but a read failed (a statement timeout)."""
        return self.unreadable()

    def unbuildable(self) -> list[Metric]:
        """What a scrape answers when the figures were read but could not be built: the whole scrape
        failed before (every series gone), and "the store is down" would be no truer."""
        return []


class MissingReadsCollector:
    """``factmill_metrics_unread{collector}``: 1 for each collector whose figures the scrape could not
    read or build (registered after them). Their families were simply absent, and the alerts on them
    (a page's text still held at a provider, Postgres's connections) went quiet unsaid."""

    def __init__(self, collectors: dict[str, ScrapeTimeCollector[Any]]) -> None:
        self.collectors = collectors

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        gauge = GaugeMetricFamily(
            "factmill_metrics_unread",
            "1 if this scrape could not read or build a collector's figures from Postgres (see the log); "
            "the store's figures read but not built are said by factmill_metrics_unbuilt instead",
            labels=["collector"],
        )
        for name, collector in self.collectors.items():
            gauge.add_metric([name], 1 if collector.failed else 0)
        return [gauge]


__all__ = [
    "METRICS_STATEMENT_TIMEOUT",
    "OUTAGE_SECONDS",
    "MissingReadsCollector",
    "ScrapeTimeCollector",
    "note_outage",
    "outage_persists",
    "outage_seen",
]
