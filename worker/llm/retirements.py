"""The providers' announced shutdown dates of the models Factmill names: a model past its date answers
every call with an error, so a deployment is told at start rather than by its jobs failing."""

from __future__ import annotations

from datetime import date

from worker.core.model_names import undated_model

# From the providers' deprecation pages (docs.claude.com/en/docs/about-claude/model-deprecations,
# developers.openai.com/api/docs/deprecations), by undated name. Claude 3.5 Haiku, Factmill's Anthropic
# default until 2026-12, was retired on 2026-02-19: every call of a deployment that named no model failed.
SHUTDOWN_DATES: dict[str, date] = {
    "claude-3-5-haiku": date(2026, 2, 19),
    "gpt-5": date(2026, 12, 11),
    "gpt-5-mini": date(2026, 12, 11),
    "gpt-5-nano": date(2026, 12, 11),
    "gpt-4o": date(2027, 1, 14),
    "gpt-4o-mini": date(2027, 1, 14),
    "gpt-4.1": date(2027, 1, 14),
    "gpt-4.1-mini": date(2027, 1, 14),
}
WARN_DAYS_BEFORE = 60  # Anthropic's least notice; OpenAI gives at least three months


def retirement_note(model: str, today: date) -> str | None:
    """What to tell an operator of ``model`` (a snapshot or alias of a listed one) on ``today``: that it
    shut down, or soon will; None for a model with no announced date far off."""
    shutdown = SHUTDOWN_DATES.get(undated_model(model).removesuffix("-latest"))
    if shutdown is None or (shutdown - today).days > WARN_DAYS_BEFORE:
        return None
    if shutdown <= today:
        return (
            f"model {model!r} was shut down by its provider on {shutdown.isoformat()}: every call fails; "
            "set FACTMILL_LLM_MODEL to a current model"
        )
    return (
        f"model {model!r} shuts down on {shutdown.isoformat()} (its provider's notice): set "
        "FACTMILL_LLM_MODEL to its replacement before then"
    )
