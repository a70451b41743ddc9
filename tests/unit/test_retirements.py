"""The providers' shutdown dates: a deployment naming a retired model is told at start."""

from __future__ import annotations

from datetime import date

from worker.accounting.prices import price_of
from worker.llm.gateway import DEFAULT_MODELS
from worker.llm.retirements import SHUTDOWN_DATES, WARN_DAYS_BEFORE, retirement_note


def test_a_model_past_its_shutdown_is_named_with_the_date_and_what_to_do() -> None:
    note = retirement_note("claude-3-5-haiku-latest", date(2026, 12, 7))
    assert note is not None and "shut down by its provider on 2026-02-19" in note
    assert "FACTMILL_LLM_MODEL" in note
    snapshot = retirement_note("gpt-4o-mini-2024-07-18", date(2026, 12, 7))
    assert snapshot is not None and "shuts down on 2027-01-14" in snapshot
    assert retirement_note("gpt-4o-mini", date(2026, 1, 1)) is None  # far off: nothing to say yet
    assert retirement_note("gpt-4o-mini-search", date(2027, 2, 1)) is None  # another model's name
    assert retirement_note("claude-haiku-4-5", date(2026, 12, 7)) is None


def test_the_default_models_are_priced_and_not_retiring_within_the_notice() -> None:
    """claude-3-5-haiku-latest stayed the Anthropic default ten months past its retirement: every call of
    a deployment that named no model failed, and the simulator, which answers any name, never showed it."""
    today = date.today()
    for provider in ("openai", "anthropic"):
        model = DEFAULT_MODELS[provider]
        assert price_of(model) is not None, model
        shutdown = SHUTDOWN_DATES.get(model)
        assert shutdown is None or shutdown > today, f"the default {model} has shut down"
    assert WARN_DAYS_BEFORE >= 60
