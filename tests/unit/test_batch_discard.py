"""Deleting an ended batch's copy at the provider is best effort: a failure is logged, never fatal."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest

from worker.extraction.batch import discard_batch
from worker.llm.errors import LLMError


class Provider:
    """A batch client whose delete answers with ``error`` (or succeeds), recording what it was asked."""

    provider = "simulator"
    model = "simulator-1"

    def __init__(self, error: LLMError | None = None) -> None:
        self.error = error
        self.discarded: list[str] = []

    def discard(self, batch_id: str) -> None:
        self.discarded.append(batch_id)
        if self.error is not None:
            raise self.error

    def results(self, batch_id: str, requests: Mapping[str, object]) -> dict[str, object]:
        raise AssertionError("not used")


def test_a_deleted_copy_is_reported():
    provider = Provider()
    assert discard_batch(provider, "batch_1") is True  # type: ignore[arg-type]
    assert provider.discarded == ["batch_1"]


def test_a_failed_delete_is_logged_with_the_batch_id_and_fails_nothing(caplog: pytest.LogCaptureFixture):
    provider = Provider(LLMError("HTTP 503: overloaded", retryable=True, status=503))
    with caplog.at_level(logging.WARNING, logger="worker.extraction.batch"):
        assert discard_batch(provider, "batch_2") is False  # type: ignore[arg-type]
    (record,) = caplog.records
    assert "batch_2" in record.getMessage() and "stay at the provider" in record.getMessage()
    assert "HTTP 503" in record.getMessage()
