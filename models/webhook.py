"""Webhook deliveries by Idempotency-Key, so a repeated delivery replays the original answer."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, utcnow_column


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"

    idempotency_key: Mapped[str] = mapped_column(Text, primary_key=True)
    # sha256 of the body: the same key with a different body is a client bug, answered with 422.
    body_hash: Mapped[str]
    response: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = utcnow_column()
