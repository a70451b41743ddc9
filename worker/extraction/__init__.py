"""Fact extraction: conversation pages → segments → LLM → facts, online or as a provider batch."""

from __future__ import annotations

from worker.core.checkpoint import (
    CheckpointEntry,
    CheckpointState,
    PrefixHasher,
    decode_checkpoint_entry,
    encode_checkpoint_entry,
    extract_conversation_facts_fingerprint,
    messages_hash,
)
from worker.extraction.batch import (
    BatchExtraction,
    BatchExtractionCounters,
    batch_extraction,
    run_batch_extraction,
)
from worker.extraction.committer import SegmentCommitter, SegmentResults
from worker.extraction.ingest import (
    IngestReport,
    PageFileError,
    ingest_paths,
    iter_page_files,
    load_page_file,
)
from worker.extraction.options import (
    CONVERSATION_PAGE_TYPES,
    OP_NAME,
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    CheckpointConflictError,
    ExtractionCounters,
    ExtractionDisabledError,
    ExtractionProgress,
    ExtractOptions,
    NoProgress,
    PageReport,
)
from worker.extraction.pages import PageIn, UpsertResult, content_hash, store_page, upsert_page
from worker.extraction.planner import PagePlan, PagePlanner
from worker.extraction.prompts import LLM_PURPOSE, extraction_request
from worker.extraction.segments import (
    MAX_OUTPUT_TOKENS_CEILING,
    TRUNCATION_RETRY_FACTOR,
    Attempt,
    SegmentResult,
    classify_reply,
    extract_segment,
)
from worker.extraction.service import (
    ExtractionRun,
    OnlineExtraction,
    extract_conversation_facts,
    extract_pages,
    run_extract_conversation_facts,
)
from worker.extraction.store import (
    TERMINAL_AUDIT_FACT,
    TERMINAL_ROW_NUM,
    ExtractionStore,
    PageRef,
    SegmentPlace,
)

__all__ = [
    "CONVERSATION_PAGE_TYPES",
    "LLM_PURPOSE",
    "MAX_OUTPUT_TOKENS_CEILING",
    "OP_NAME",
    "PER_SEGMENT_SOURCE_PREFIX",
    "TERMINAL_AUDIT_FACT",
    "TERMINAL_AUDIT_SOURCE",
    "TERMINAL_ROW_NUM",
    "TRUNCATION_RETRY_FACTOR",
    "Attempt",
    "BatchExtraction",
    "BatchExtractionCounters",
    "CheckpointConflictError",
    "CheckpointEntry",
    "CheckpointState",
    "ExtractOptions",
    "ExtractionCounters",
    "ExtractionDisabledError",
    "ExtractionProgress",
    "ExtractionRun",
    "ExtractionStore",
    "IngestReport",
    "NoProgress",
    "OnlineExtraction",
    "PageFileError",
    "PageIn",
    "PagePlan",
    "PagePlanner",
    "PageRef",
    "PageReport",
    "PrefixHasher",
    "SegmentCommitter",
    "SegmentPlace",
    "SegmentResult",
    "SegmentResults",
    "UpsertResult",
    "batch_extraction",
    "classify_reply",
    "content_hash",
    "decode_checkpoint_entry",
    "encode_checkpoint_entry",
    "extract_conversation_facts",
    "extract_conversation_facts_fingerprint",
    "extract_pages",
    "extract_segment",
    "extraction_request",
    "ingest_paths",
    "iter_page_files",
    "load_page_file",
    "messages_hash",
    "run_batch_extraction",
    "run_extract_conversation_facts",
    "store_page",
    "upsert_page",
]
