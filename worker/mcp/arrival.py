"""When an MCP tool call arrived: the date an append is checked against a transcript's erasure with."""

from __future__ import annotations

import time
from contextvars import ContextVar
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

# When the current tool call arrived (time.monotonic(), set by the server before the key's check and the
# wait for a thread of its pool or a pooled connection): None outside a served call.
ARRIVED: ContextVar[float | None] = ContextVar("factmill_mcp_arrived", default=None)


def arrived_at(session: Session) -> datetime:
    """The current call's arrival by the database's clock, which dates erasures (stdio runs on the
    agent's machine): its clock now less the time the call waited since it arrived. Dated as its
    transaction began, an append that arrived before an erasure and waited past it began the transcript
    again with its words. clock_timestamp(), not now(): the transaction may have begun on a key's lock,
    whose wait is in the call's already (counted twice, an append sent just after an erasure was dated
    before it)."""
    connection = session.connection()  # first: a pooled connection's wait is in the call's wait too
    since = ARRIVED.get()
    waited = 0.0 if since is None else max(0.0, time.monotonic() - since)
    interval = func.make_interval(0, 0, 0, 0, 0, 0, waited)
    arrived = connection.execute(select(func.clock_timestamp() - interval)).scalar()
    assert arrived is not None
    return arrived
