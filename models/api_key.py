"""API keys: who may call the API, with which scopes, over which sources (only the hash is stored)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, utcnow_column

# metrics: /metrics alone, for the Prometheus that scrapes it (admin would let it change the config).
API_SCOPES = ("read", "ingest", "admin", "metrics")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str]
    # The first characters of the key, shown by `factmill keys list` so a key can be recognised.
    prefix: Mapped[str]
    # Hex sha256 of the whole key; the key itself is shown once, at creation, and never stored.
    key_hash: Mapped[str] = mapped_column(unique=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False)
    # None: every source; else only these.
    source_ids: Mapped[list[str] | None] = mapped_column(ARRAY(Text), nullable=True)
    created_at: Mapped[datetime] = utcnow_column()
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]
