"""Which of two deliveries of a page came first, as the 409 a refused one gets says it (pure: no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from worker.core.moments import within_a_second
from worker.extraction.pages import StaleDeliveryError

SECOND = datetime(2026, 12, 7, 10, 0, 0, tzinfo=UTC)


def test_within_a_second_counts_only_what_came_after_in_that_second() -> None:
    assert within_a_second(SECOND, SECOND + timedelta(milliseconds=999))
    assert not within_a_second(SECOND, SECOND + timedelta(seconds=1))
    # Stored before the delivery's date (a row changed between the write and its re-read): not the same
    # second's ambiguity, and no "sign it again a second later".
    assert not within_a_second(SECOND, SECOND - timedelta(milliseconds=1))


def test_only_a_signed_delivery_in_the_stored_ones_second_is_not_known_to_be_older() -> None:
    stored = SECOND + timedelta(milliseconds=300)
    refused = StaleDeliveryError("default", "a", SECOND, stored)
    assert refused.in_its_second
    assert "is not known to be newer than the stored one" in refused.described(signed=True)
    assert "is older than the stored one" in refused.described(signed=False)  # keyed: by the microsecond
    assert "is older than the stored one" in str(refused)
    erased = StaleDeliveryError("default", "a", SECOND, stored, erased=True)
    assert "is older than the page's erasure" in erased.described(signed=True)  # its own hint says the rest
    plainly = StaleDeliveryError("default", "a", SECOND - timedelta(seconds=5), stored)
    assert not plainly.in_its_second and "is older than" in plainly.described(signed=True)
