"""The extraction request: the system prompt, the segment turns and the facts schema as one ChatRequest."""

from __future__ import annotations

from collections.abc import Sequence

from worker.core.facts import extraction_system_prompt, facts_json_schema, segment_user_message
from worker.llm.types import ChatRequest

LLM_PURPOSE = "extraction"


def extraction_request(
    turns: Sequence[tuple[str, str]], max_facts: int, max_output_tokens: int
) -> ChatRequest:
    """The chat request for a segment's turns (the first turn is ``segment_user_message(rendered)``)."""
    return ChatRequest(
        purpose=LLM_PURPOSE,
        system=extraction_system_prompt(max_facts),
        messages=tuple(turns),
        max_tokens=max_output_tokens,
        json_schema=facts_json_schema(max_facts),
        schema_name="facts",
        cache_key=f"factmill-extraction-v1-{max_facts}",
    )


def first_turn(rendered_segment: str) -> tuple[str, str]:
    """The user turn that hands the model one rendered segment."""
    return ("user", segment_user_message(rendered_segment))
