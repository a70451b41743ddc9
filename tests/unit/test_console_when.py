"""How the CLI's tables show a time: UTC to the minute, whatever it was given."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from worker.cli.console import when


def test_a_time_is_shown_in_utc_to_the_minute() -> None:
    kiritimati = timezone(timedelta(hours=14))
    moment = datetime(2026, 12, 5, 3, 19, 42, tzinfo=kiritimati)
    assert when(moment) == "2026-12-04 13:19"
    assert when(moment.isoformat()) == "2026-12-04 13:19"  # as a JSON report holds it
    assert when("2026-12-04T13:19:42.123456+00:00") == "2026-12-04 13:19"
    assert when(datetime(2026, 12, 4, 13, 19, tzinfo=UTC)) == when(datetime(2026, 12, 4, 13, 19))
    assert when(None) == ""
