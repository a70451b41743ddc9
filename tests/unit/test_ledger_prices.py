"""The ledger's price table: the live llm.prices override, parsed once per value; one stored before a
rule refused it is named in a warning (once) and the list prices stand in."""

from __future__ import annotations

import logging
from decimal import Decimal

import pytest

from worker.accounting import PRICES, Ledger


def test_a_stored_override_that_is_refused_now_is_named_once(caplog: pytest.LogCaptureFixture):
    stored = {"llm.prices": '{"gpt-4o": {"input": 1, "output": 2, "cache_reed": 0}}'}
    ledger = Ledger(stored.get)
    with caplog.at_level(logging.WARNING, logger="worker.accounting.ledger"):
        assert ledger.prices()["gpt-4o"] == PRICES["gpt-4o"]
        assert ledger.prices()["gpt-4o"] == PRICES["gpt-4o"]
    (record,) = caplog.records
    assert "llm.prices is not used" in record.getMessage() and "'cache_reed'" in record.getMessage()

    stored["llm.prices"] = '{"gpt-4o": {"input": 1, "output": 2}}'  # set again: used from the next call
    assert ledger.prices()["gpt-4o"].output == Decimal(2)
    del stored["llm.prices"]
    assert ledger.prices() == PRICES
