"""The config keys' typo hint: only a key that keeps what the typed one names (the feature, the scope)."""

from __future__ import annotations

import pytest

from worker.config_store import UnknownConfigKeyError, check_key


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("facts.extraction_enable", "facts.extraction_enabled"),
        ("compaction.enable", "compaction.enabled"),
        ("llm.daily_budget_usd", "llm.budget_daily_usd"),
        ("llm.search_budget_daily_usd", "llm.budget_search_daily_usd"),
        ("search.budget_daily_usd", "llm.budget_search_daily_usd"),
        # The closest spelling named the extraction switch, and the work budget: taken, the hint
        # switched off extraction instead of compaction, or capped every job at the search figure.
        ("facts.compaction_enabled", None),
    ],
)
def test_a_mistyped_key_is_offered_only_a_key_that_keeps_its_words(typed: str, hint: str | None) -> None:
    with pytest.raises(UnknownConfigKeyError) as refused:
        check_key(typed)
    said = str(refused.value)
    assert f"unknown config key {typed!r}" in said and "The keys are: " in said
    if hint is None:
        assert "did you mean" not in said
    else:
        assert f"did you mean {hint!r}?" in said
