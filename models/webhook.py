"""Webhook deliveries by Idempotency-Key, so a repeated delivery replays the original answer."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Index, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, utcnow_column


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    # The oldest answers first, for forget_deliveries.
    __table_args__ = (Index("ix_webhook_deliveries_created_at", "created_at"),)

    idempotency_key: Mapped[str] = mapped_column(Text, primary_key=True)
    # sha256 of the body: the same key with a different body is a client bug, answered with 422.
    body_hash: Mapped[str]
    response: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = utcnow_column()


# Oldest first, so a backlog shrinks from its old end; SKIP LOCKED, so two sweeps never wait on each other.
# By ctid (a TID scan of the rows found and locked): by key, the planner scanned the whole table to
# match them (0.24 s a batch at a million rows, bench/forget_deliveries.py).
_FORGET = text(
    "DELETE FROM webhook_deliveries WHERE ctid = ANY(ARRAY("
    " SELECT ctid FROM webhook_deliveries WHERE created_at < now() - :kept"
    " ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
)


def forget_deliveries(session: Session, kept: timedelta, limit: int) -> int:
    """Delete up to ``limit`` stored answers older than ``kept``, oldest first, in the caller's
    transaction; returns how many went. A key delivered again after that is a new delivery."""
    return session.execute(_FORGET, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
