"""Fact extraction: conversation pages → segments → LLM → facts, online or as a provider batch."""

from __future__ import annotations

from worker.core.checkpoint import (
    decode_checkpoint_entry,
    encode_checkpoint_entry,
    extract_conversation_facts_fingerprint,
)
from worker.extraction.batch import BatchExtractionCounters, run_batch_extraction
from worker.extraction.options import (
    OP_NAME,
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    ExtractionCounters,
    ExtractionDisabledError,
    ExtractOptions,
    NoProgress,
    PageReport,
)
from worker.extraction.pages import PageIn, upsert_page
from worker.extraction.segments import extract_segment
from worker.extraction.service import run_extract_conversation_facts

__all__ = [
    "OP_NAME",
    "PER_SEGMENT_SOURCE_PREFIX",
    "TERMINAL_AUDIT_SOURCE",
    "BatchExtractionCounters",
    "ExtractOptions",
    "ExtractionCounters",
    "ExtractionDisabledError",
    "NoProgress",
    "PageIn",
    "PageReport",
    "decode_checkpoint_entry",
    "encode_checkpoint_entry",
    "extract_conversation_facts_fingerprint",
    "extract_segment",
    "run_batch_extraction",
    "run_extract_conversation_facts",
    "upsert_page",
]
