"""When an MCP tool call arrived: the date an append is checked against a transcript's erasure with."""

from __future__ import annotations

from contextvars import ContextVar
from datetime import datetime

from sqlalchemy.orm import Session

from worker.deliveries import arrival_by_database_clock

# When the current tool call arrived (time.monotonic(), set by the server before the key's check and the
# wait for a thread of its pool or a pooled connection): None outside a served call.
ARRIVED: ContextVar[float | None] = ContextVar("factmill_mcp_arrived", default=None)


def arrived_at(session: Session) -> datetime:
    """The current call's arrival by the database's clock (stdio runs on the agent's machine). Dated as
    its transaction began, an append that arrived before an erasure and waited past it began the
    transcript again with its words."""
    return arrival_by_database_clock(session, ARRIVED.get())
