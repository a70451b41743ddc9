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


def test_a_refusal_s_words_stay_out_of_the_ledger() -> None:
    """llm_calls rows outlive a page's or a transcript's erasure: a refusal's reason (the model's words,
    quoting the segment or beginning the summary) is kept as its length; other errors as they are."""
    from worker.accounting import LLMCallRecord
    from worker.accounting.ledger import kept_error

    said = "I can't share Alice's diagnosis from the segment"
    refused = LLMCallRecord("extraction", "openai", "gpt-4o", None, 5, "refusal", error=said)
    assert (
        kept_error(refused)
        == f"the model refused ({len(said)} characters of reply, kept with what it was about)"
    )
    failed = LLMCallRecord(
        "extraction", "openai", "gpt-4o", None, 5, "provider_error", error="HTTP 500: boom"
    )
    assert kept_error(failed) == "HTTP 500: boom"
    assert Ledger({}.get).row(refused)["error"] == kept_error(refused)


def test_the_gateways_default_embedding_model_has_a_price() -> None:
    """The gateway embeds with text-embedding-3-small unless told otherwise; unpriced, every embedding
    (new facts, searches) cost 0, and the search budget never counted one."""
    from worker.accounting.prices import cost_usd, price_of
    from worker.llm.openai_compat import OpenAIChatClient
    from worker.llm.types import Usage

    default_model = OpenAIChatClient(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1").embedding_model
    assert price_of(default_model) is not None
    assert cost_usd(default_model, Usage(input_tokens=1_000_000)) == Decimal("0.02")
    assert cost_usd("text-embedding-3-large", Usage(input_tokens=1_000_000)) == Decimal("0.13")


def test_a_model_with_no_price_is_named_once_and_an_override_of_zero_quiets_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model the list prices do not know (a newer release, an OpenAI-compatible server's) cost $0
    without a word: no budget counted its calls. The simulator is unpriced on purpose; a call that used
    no tokens cost nothing."""
    from worker.accounting import LLMCallRecord
    from worker.llm.types import Usage

    used = Usage(input_tokens=1000, output_tokens=100)

    def call(model: str, provider: str = "openai", usage: Usage | None = used) -> LLMCallRecord:
        return LLMCallRecord("extraction", provider, model, usage, 5, "ok")

    stored: dict[str, str] = {}
    ledger = Ledger(stored.get)
    with caplog.at_level(logging.WARNING, logger="worker.accounting.ledger"):
        assert ledger.cost(call("gpt-4o-mini-2024-07-18")) > 0  # priced: no word
        assert ledger.cost(call("simulator-1", "simulator")) == 0
        assert ledger.cost(call("gpt-9-mini", usage=Usage())) == 0  # no tokens: no word yet
        assert [ledger.cost(call("gpt-9-mini")) for _ in range(3)] == [0, 0, 0]
    (record,) = caplog.records
    assert record.getMessage().startswith("no price for model gpt-9-mini: its calls are recorded at $0")
    assert "set llm.prices" in record.getMessage()
    caplog.clear()
    stored["llm.prices"] = '{"local-llama": {"input": 0, "output": 0}}'
    with caplog.at_level(logging.WARNING, logger="worker.accounting.ledger"):
        assert ledger.cost(call("local-llama", "openai-compatible")) == 0
    assert caplog.records == []


def test_a_provider_error_is_kept_as_far_as_every_purpose_keeps_it() -> None:
    """A provider's words are kept to 1,000 characters (the README, extraction's rows); compaction's,
    consolidation's and search's rows cut them again at 500."""
    from worker.accounting import LLMCallRecord
    from worker.accounting.ledger import kept_error
    from worker.llm.errors import LLMError

    said = "HTTP 503: " + "the upstream said why at length " * 28  # about 900 characters
    record = LLMCallRecord.failed("compaction", object(), LLMError(said, retryable=True, status=503), 12)
    assert kept_error(record) == said


@pytest.mark.parametrize(
    ("model", "listed"),
    [
        ("gpt-5-mini-2025-08-07", "gpt-5-mini"),
        ("gpt-5-2025-08-07", "gpt-5"),
        ("claude-haiku-4-5-20251001", "claude-haiku-4-5"),
        ("claude-opus-4-5-20251101", "claude-opus-4-5"),
    ],
)
def test_current_models_have_list_prices(model: str, listed: str) -> None:
    """The models the installed SDKs name (a reply names its dated snapshot) were unpriced: their calls
    cost $0 and no budget ever counted them."""
    from worker.accounting.prices import PRICES, price_of

    assert price_of(model) == PRICES[listed] and PRICES[listed].input > 0
