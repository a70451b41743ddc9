"""Model names as providers write them: a dated snapshot's name less its date."""

from __future__ import annotations

import re

# A snapshot's date at the end of a model's name: OpenAI answers "gpt-4o-mini" with
# "gpt-4o-mini-2024-07-18", Anthropic "claude-3-5-haiku-latest" with "claude-3-5-haiku-20241022".
_SNAPSHOT = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")


def undated_model(model: str) -> str:
    """``model`` without a snapshot's date at its end (itself when it has none)."""
    return _SNAPSHOT.sub("", model)
