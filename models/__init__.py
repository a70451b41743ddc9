"""SQLAlchemy models, one module per aggregate; importing this package registers them all."""

from __future__ import annotations

from models.api_key import API_SCOPES, ApiKey
from models.backfill import BACKFILL_STATUSES, Backfill, BackfillBatch, BackfillRequest, ProviderCopy
from models.base import NAMING_CONVENTION, Base
from models.calibration import CalibrationObservation, CalibrationThreshold
from models.checkpoint import OpCheckpoint
from models.compaction import COMPACTION_STATUSES, MESSAGE_ROLES, Compaction, Transcript, TranscriptMessageRow
from models.config import ConfigEntry
from models.consolidation import ConsolidationCheckpoint, ConsolidationDecision
from models.erasure import Erasure, TranscriptErasure
from models.fact import (
    FACT_KINDS,
    NOTABILITY_LEVELS,
    SEGMENT_OUTCOMES,
    ExtractionAudit,
    Fact,
    existing_fact_ids,
)
from models.job import JOB_STATUSES, Job, expire_jobs
from models.llm_call import LLMCall, LLMSpendDay, expire_ledger
from models.page import Page, page_id_of
from models.totals import (
    BACKFILL_COST_COUNTER,
    BACKFILL_REQUESTS_COUNTER,
    COMPACTIONS_COUNTER,
    DECISIONS_COUNTER,
    FACTS_COUNTER,
    JOBS_ENDED_COUNTER,
    SEGMENTS_COUNTER,
    TOKENS_SAVED_COUNTER,
    JobTotal,
    LLMCallTotal,
    RowCount,
    fold_totals,
)
from models.webhook import (
    WebhookDelivery,
    forget_deliveries,
    forget_page_in_deliveries,
    forget_transcript_in_deliveries,
)

__all__ = [
    "API_SCOPES",
    "BACKFILL_COST_COUNTER",
    "BACKFILL_REQUESTS_COUNTER",
    "BACKFILL_STATUSES",
    "COMPACTIONS_COUNTER",
    "COMPACTION_STATUSES",
    "DECISIONS_COUNTER",
    "FACTS_COUNTER",
    "FACT_KINDS",
    "JOBS_ENDED_COUNTER",
    "JOB_STATUSES",
    "MESSAGE_ROLES",
    "NAMING_CONVENTION",
    "NOTABILITY_LEVELS",
    "SEGMENTS_COUNTER",
    "SEGMENT_OUTCOMES",
    "TOKENS_SAVED_COUNTER",
    "ApiKey",
    "Backfill",
    "BackfillBatch",
    "BackfillRequest",
    "Base",
    "CalibrationObservation",
    "CalibrationThreshold",
    "Compaction",
    "ConfigEntry",
    "ConsolidationCheckpoint",
    "ConsolidationDecision",
    "Erasure",
    "ExtractionAudit",
    "Fact",
    "Job",
    "JobTotal",
    "LLMCall",
    "LLMCallTotal",
    "LLMSpendDay",
    "OpCheckpoint",
    "Page",
    "ProviderCopy",
    "RowCount",
    "Transcript",
    "TranscriptErasure",
    "TranscriptMessageRow",
    "WebhookDelivery",
    "existing_fact_ids",
    "expire_jobs",
    "expire_ledger",
    "fold_totals",
    "forget_deliveries",
    "forget_page_in_deliveries",
    "forget_transcript_in_deliveries",
    "page_id_of",
]
