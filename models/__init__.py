"""SQLAlchemy models, one module per aggregate; importing this package registers them all."""

from __future__ import annotations

from models.base import NAMING_CONVENTION, Base
from models.checkpoint import OpCheckpoint
from models.config import ConfigEntry
from models.fact import FACT_KINDS, NOTABILITY_LEVELS, SEGMENT_OUTCOMES, ExtractionAudit, Fact
from models.job import JOB_STATUSES, Job
from models.llm_call import LLMCall
from models.page import Page
from models.webhook import WebhookDelivery

__all__ = [
    "FACT_KINDS",
    "JOB_STATUSES",
    "NAMING_CONVENTION",
    "NOTABILITY_LEVELS",
    "SEGMENT_OUTCOMES",
    "Base",
    "ConfigEntry",
    "ExtractionAudit",
    "Fact",
    "Job",
    "LLMCall",
    "OpCheckpoint",
    "Page",
    "WebhookDelivery",
]
