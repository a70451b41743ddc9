"""Deliveries made idempotent: a repeat with the same Idempotency-Key gets the stored answer.

``deliver_once`` owns its transaction (it takes the sessionmaker): what a delivery writes and the
answer kept for its key (``webhook_deliveries``) commit together, so either both are kept or neither.
The API's ingestion routes and the MCP server's append tool use it (each under its own route label).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import bindparam, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from models.tables import WEBHOOK_DELIVERIES
from worker.core.signing import IDEMPOTENCY_HEADER
from worker.db import made_again_on_deadlock

T = TypeVar("T")

REPLAYED_HEADERS = {"Idempotent-Replayed": "true"}

Answer = dict[str, Any]


class DeliveryKeyReusedError(ValueError):
    """The key was used before for a delivery with another body (the API answers 422)."""


# Core statements built once: a keyed delivery runs both (through the ORM they were a third of its CPU).
_STORED_ANSWER = select(WEBHOOK_DELIVERIES.c.body_hash, WEBHOOK_DELIVERIES.c.response).where(
    WEBHOOK_DELIVERIES.c.idempotency_key == bindparam("key")
)
_KEEP_ANSWER = insert(WEBHOOK_DELIVERIES)
# Copies of one keyed delivery take turns: a retry sent while its first try still ran read no stored
# answer, wrote beside it, and failed on what the first stored ("tool call already answered": 422;
# "older than the stored page": 409) before reaching the key's unique index, which would have replayed
# the answer. Two 32-bit keys: a key space apart from the one-bigint locks elsewhere.
DELIVERY_LOCK_CLASS = 0x464D_444C  # "FMDL"
_TAKE_TURNS = select(func.pg_advisory_xact_lock(DELIVERY_LOCK_CLASS, func.hashtext(bindparam("key"))))


def _stored_answer(session: Session, key: str, body_hash: str) -> Answer | None:
    prior = session.connection().execute(_STORED_ANSWER, {"key": key}).one_or_none()
    if prior is None:
        return None
    if not hmac.compare_digest(prior.body_hash, body_hash):
        raise DeliveryKeyReusedError(
            f"{IDEMPOTENCY_HEADER} reused with a different body; use a new key per delivery"
        )
    return dict(prior.response)


def replayed_answer(factory: sessionmaker[Session], key: str | None, body_hash: str) -> Answer | None:
    """The answer stored for this delivery, or None: asked when its body no longer passes the checks (a
    rule tightened by a release since it was accepted), so the sender's retry within the window still
    gets what it was answered, as the README promises, not a 422 for a body already stored."""
    if key is None:
        return None
    with factory() as session:
        return _stored_answer(session, key, body_hash)


WEBHOOK_SENDER = "signature"  # Ingest.sender of a delivery signed with the webhook secret


def scoped_key(route: str, subject: str, key: str | None, sender: str) -> str | None:
    """The stored key of a delivery: sha256 (hex) of (route, subject, Idempotency-Key, sender), so one
    key sent to two routes, to two transcripts, or by two senders (two API keys: two tenants) are two
    deliveries; without the sender, a tenant's key collided with another's ("reused with a different
    body") and told it the key was in use. A signed delivery's digest is the one kept before senders
    counted (migration 0020's), so its stored answers still replay; a key's sender follows a control
    character no Idempotency-Key may hold. Only the digest is kept: a key a sender chose may name a
    person (``alice-chat-2024-03-15``), and an erasure could not know to remove it."""
    if key is None:
        return None
    # Transcript "a|b" with key "k" and transcript "a" with key "b|k" were one scope (the second got the
    # first's answer, its messages never stored): a subject holding a bar is set apart by a control
    # character no id or key may hold. Every other subject keeps the digest it had.
    separator = "\x1e" if "|" in subject else "|"
    scope = f"{route}{separator}{subject}{separator}{key}"
    if sender != WEBHOOK_SENDER:
        scope += f"\x1f{sender}"
    return hashlib.sha256(scope.encode()).hexdigest()


def deliver_once(
    factory: sessionmaker[Session],
    key: str | None,
    body_hash: str,
    write: Callable[[Session], tuple[Answer, T]],
) -> tuple[Answer, T | None]:
    """Run ``write`` (which returns the answer and anything else the caller needs) in one transaction
    and keep its answer under ``key``. Returns (answer, what write returned), or (the stored answer,
    None) when ``key`` was delivered before; DeliveryKeyReusedError when it was delivered with a
    different body.

    A transaction Postgres ended to break a deadlock is made again (worker.db.made_again_on_deadlock): it
    was all rolled back, and nothing is sent before the commit, so ``write`` must touch nothing but the
    session. Two batches emptying pages whose facts name the same entities in crossed orders, or a
    delivery meeting a retention sweep's cascade, deadlocked: a 500 to a sender who did nothing wrong."""
    return made_again_on_deadlock(_deliver_once, factory, key, body_hash, write)


def _deliver_once(
    factory: sessionmaker[Session],
    key: str | None,
    body_hash: str,
    write: Callable[[Session], tuple[Answer, T]],
) -> tuple[Answer, T | None]:
    try:
        with factory.begin() as session:
            if key is not None:
                session.connection().execute(_TAKE_TURNS, {"key": key})
                prior = _stored_answer(session, key, body_hash)
                if prior is not None:
                    return prior, None
            answer, outcome = write(session)
            if key is not None:
                session.connection().execute(
                    _KEEP_ANSWER, {"idempotency_key": key, "body_hash": body_hash, "response": answer}
                )
    except IntegrityError:
        # A concurrent delivery with the same key committed first: answer what it answered.
        prior = replayed_answer(factory, key, body_hash)
        if prior is None:
            raise
        return prior, None
    return answer, outcome


__all__ = [
    "REPLAYED_HEADERS",
    "WEBHOOK_SENDER",
    "Answer",
    "DeliveryKeyReusedError",
    "deliver_once",
    "replayed_answer",
    "scoped_key",
]


def arrival_by_database_clock(session: Session, arrived: float | None) -> datetime:
    """When a delivery arrived (``arrived``: its time.monotonic(); None: now) by the database's clock,
    which dates erasures: the clock now less the time waited since. Dated by the API host's clock, a
    keyed append that arrived before an erasure and waited on its lock was dated after it, with the host
    ahead, and began the transcript again. clock_timestamp(), not now(): the transaction may have
    begun on a key's lock, whose wait is in the delivery's already (counted twice, one sent just after
    an erasure was dated before it)."""
    connection = session.connection()  # first: a pooled connection's wait is in the delivery's too
    waited = 0.0 if arrived is None else max(0.0, time.monotonic() - arrived)
    interval = func.make_interval(0, 0, 0, 0, 0, 0, waited)
    at = connection.execute(select(func.clock_timestamp() - interval)).scalar()
    assert at is not None
    return at
