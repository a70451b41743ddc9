"""Moments a client names: one whose ISO text names no zone is UTC, wherever it is read."""

from __future__ import annotations

from datetime import UTC, datetime


def as_utc(moment: datetime) -> datetime:
    """``moment`` with UTC as its zone when it has none (a naive time compared with Postgres's
    timestamptz would otherwise be read in the server session's TimeZone, which varies by server)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


__all__ = ["as_utc"]
