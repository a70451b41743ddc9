"""The bundled LLM simulator: not a real model, and never imported by production code paths."""

from __future__ import annotations

from worker.simulator.embeddings import DEFAULT_EMBEDDING_DIMENSIONS, embed_text
from worker.simulator.extractor import FACT_KINDS, NOTABILITIES, ExtractedFact, extract_facts
from worker.simulator.prompt import (
    MAX_FACTS_CEILING,
    PromptMessage,
    estimate_tokens,
    find_segment,
    parse_segment_lines,
    requested_max_facts,
)
from worker.simulator.replies import SimReply, fill_json_schema, reply_to, text_reply

__all__ = [
    "DEFAULT_EMBEDDING_DIMENSIONS",
    "FACT_KINDS",
    "MAX_FACTS_CEILING",
    "NOTABILITIES",
    "ExtractedFact",
    "PromptMessage",
    "SimReply",
    "embed_text",
    "estimate_tokens",
    "extract_facts",
    "fill_json_schema",
    "find_segment",
    "parse_segment_lines",
    "reply_to",
    "requested_max_facts",
    "text_reply",
]
