"""Declarative base with a constraint naming convention shared by every model."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import DateTime, Float, Integer, MetaData, Text, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    # The column type each annotation means, so a plain ``Mapped[str]`` is TEXT NOT NULL and
    # ``Mapped[str | None]`` nullable TEXT; only ids (BIGINT), JSONB and the like name their type.
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        str: Text(),
        int: Integer(),
        float: Float(),
        datetime: DateTime(timezone=True),
    }


def utcnow_column() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def count_column() -> Mapped[int]:
    """A non-negative tally that starts at 0 (tokens, attempts, counts)."""
    return mapped_column(Integer, nullable=False, server_default="0")
