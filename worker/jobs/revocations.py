"""Lease revocations heard at once: a transaction that takes running jobs' leases away (their subject
erased) announces it with NOTIFY, and every worker process LISTENs, so those jobs stop before their next
LLM call rather than at their next heartbeat (FACTMILL_JOB_HEARTBEAT_SECONDS later: seconds in which an
erased page's text still went to the model).

The heartbeat stays the rule and this is the fast path: a notification is lost while the listener
reconnects, and Postgres sends none through a transaction-mode pooler; the heartbeat then finds the
lease gone at its next beat, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from worker.core.errors import error_summary

logger = logging.getLogger(__name__)

CHANNEL = "factmill_leases_revoked"
# A payload holds at most 8,000 bytes: ids go out in runs that fit with room to spare.
_IDS_PER_NOTICE = 500
# How long the first watch of a process waits for the listener to be LISTENing (a revocation sent
# before that is heard only by the heartbeat), and how long a lost listener waits to reconnect.
_READY_WAIT_SECONDS = 2.0
_RECONNECT_SECONDS = 2.0
_POLL_SECONDS = 0.5
# A listener outlives its last job by this much, so a worker fed a job now and then keeps its connection
# (each new one is a connect and a LISTEN before the job's first call).
_LINGER_SECONDS = 60.0


def announce_revoked(session: Session, job_ids: Iterable[int]) -> None:
    """Tell every worker, at the commit of ``session``'s transaction, that these jobs' leases are gone
    (a rolled-back transaction sends nothing: Postgres delivers notifications at commit)."""
    ids = sorted(set(job_ids))
    for start in range(0, len(ids), _IDS_PER_NOTICE):
        payload = ",".join(str(job_id) for job_id in ids[start : start + _IDS_PER_NOTICE])
        session.execute(select(func.pg_notify(CHANNEL, payload)))


def _job_ids(payload: str) -> list[int]:
    return [int(part) for part in payload.split(",") if part.strip().isdigit()]


class _Listener:
    """One LISTENing connection per engine per process while it runs jobs, and those jobs' flags. It
    closes once no job has been watched for a moment (tests drop databases, and an idle process
    holds no connection for it)."""

    def __init__(self, engine: Engine, job_id: int, revoked: threading.Event) -> None:
        self.engine = engine
        # Its first job watched before its thread starts: a first connect failing at once found nothing
        # watched and closed the listener before the job was in.
        self.watched: dict[int, set[threading.Event]] = {job_id: {revoked}}
        self.lock = threading.Lock()
        self.settled = (
            threading.Event()
        )  # listening, or its first try failed: the first watch waits no longer
        self.closing = False
        self.idle_since = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="lease-revocations", daemon=True)
        self.thread.start()

    def watch(self, job_id: int, revoked: threading.Event) -> bool:
        """Watch ``job_id``; False when this listener is closing (the caller starts another)."""
        with self.lock:
            if self.closing:
                return False
            self.watched.setdefault(job_id, set()).add(revoked)
            return True

    def unwatch(self, job_id: int, revoked: threading.Event) -> None:
        with self.lock:
            events = self.watched.get(job_id)
            if events is not None:
                events.discard(revoked)
                if not events:
                    del self.watched[job_id]
            if not self.watched:
                self.idle_since = time.monotonic()

    def _unwatched(self) -> bool:
        with self.lock:
            if not self.watched:
                self.closing = True
            return self.closing

    def _idle(self) -> bool:
        with self.lock:
            if not self.watched and time.monotonic() - self.idle_since > _LINGER_SECONDS:
                self.closing = True
            return self.closing

    def _heard(self, payload: str) -> None:
        with self.lock:
            hit = [(job_id, self.watched.get(job_id, set())) for job_id in _job_ids(payload)]
            for job_id, events in hit:
                for revoked in events:
                    revoked.set()
                if events:
                    logger.info("job %s: its lease was revoked; it stops before its next LLM call", job_id)

    def _run(self) -> None:
        warned = False
        try:
            while not self._idle():
                try:
                    self._listen()
                except Exception as exc:  # the heartbeat still covers every job; try again shortly
                    self.settled.set()
                    if self._unwatched():  # (its database dropped, or restarting): none to try for
                        return
                    if not warned:
                        logger.warning("lease revocations not heard (%s); retrying", error_summary(exc))
                        warned = True
                    time.sleep(_RECONNECT_SECONDS)
        finally:
            _forget(self)

    def _listen(self) -> None:
        pooled = self.engine.raw_connection()
        connection: Any = pooled.driver_connection
        pooled.detach()  # held by this thread alone: the pool opens another in its place
        try:
            connection.autocommit = True
            connection.execute(f"LISTEN {CHANNEL}")
            self.settled.set()
            while not self._idle():
                for notice in connection.notifies(timeout=_POLL_SECONDS):
                    self._heard(notice.payload)
        finally:
            pooled.close()  # detached: really closed


_listeners: dict[int, _Listener] = {}
_listeners_lock = threading.Lock()


def _forget(listener: _Listener) -> None:
    with _listeners_lock:
        if _listeners.get(id(listener.engine)) is listener:
            del _listeners[id(listener.engine)]


def _forget_inherited_listeners() -> None:
    """A forked child has none of its parent's threads: it starts listeners of its own."""
    global _listeners_lock
    _listeners.clear()
    _listeners_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_inherited_listeners)


def watch(engine: Engine, job_id: int, revoked: threading.Event) -> Callable[[], None]:
    """Set ``revoked`` when a transaction announces ``job_id``'s lease revoked, until the returned
    function is called. The first watch on an engine in a process starts its listener and waits
    (briefly) until it listens; a listener down since is not waited for at every claim."""
    with _listeners_lock:
        listener = _listeners.get(id(engine))
        if listener is None or not listener.watch(job_id, revoked):
            listener = _listeners[id(engine)] = _Listener(engine, job_id, revoked)
            started = listener
        else:
            started = None
    if started is not None:
        started.settled.wait(_READY_WAIT_SECONDS)
    return partial(listener.unwatch, job_id, revoked)
