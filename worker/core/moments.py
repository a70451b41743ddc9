"""Moments a client names: one whose ISO text names no zone is UTC, wherever it is read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def as_utc(moment: datetime) -> datetime:
    """``moment`` with UTC as its zone when it has none (a naive time compared with Postgres's
    timestamptz would otherwise be read in the server session's TimeZone, which varies by server)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def erased_in_its_second(signed_at: datetime, erased_at: datetime) -> str:
    """What a 409 for a delivery signed before an erasure adds when both fall in one second: a
    signature is dated to the second, so one signed just after the erasure, in that second, counts as
    older (re-signed at once, it was refused again)."""
    if erased_at - signed_at >= timedelta(seconds=1):
        return ""
    return " (signatures are dated to the second: sign it again a second after the erasure)"


__all__ = ["as_utc", "erased_in_its_second"]
