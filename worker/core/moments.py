"""Moments a client names: one whose ISO text names no zone is UTC, wherever it is read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def as_utc(moment: datetime) -> datetime:
    """``moment`` with UTC as its zone when it has none (a naive time compared with Postgres's
    timestamptz would otherwise be read in the server session's TimeZone, which varies by server)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


# What a 409 for a signed delivery older than an erasure adds when both fall in one second: a signature
# is dated to the second, an erasure to the microsecond, so one signed just after the erasure, in its
# second, counts as older (re-signed at once, it was refused again). A keyed delivery is dated to the
# microsecond on arrival: the hint is not for it.
SAME_SECOND_HINT = " (signatures are dated to the second: sign it again a second after the erasure)"
STORED_IN_ITS_SECOND_HINT = (
    " (signatures are dated to the second, and another delivery stored the page within this one's: "
    "if this is the newer content, sign it again a second later)"
)


def within_a_second(earlier: datetime, later: datetime) -> bool:
    return timedelta(0) <= later - earlier < timedelta(seconds=1)


__all__ = ["SAME_SECOND_HINT", "STORED_IN_ITS_SECOND_HINT", "as_utc", "within_a_second"]
