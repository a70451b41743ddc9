"""A clock the test moves by hand, for code that takes a ``clock`` (and a ``sleep``) to read time."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    """This host's time, aware (to date rows a test ages against the database's now())."""
    return datetime.now(UTC)


class FakeClock:
    """Returns ``now`` when called; ``sleep`` moves it on instead of waiting."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
