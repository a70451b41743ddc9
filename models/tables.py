"""The tables of the models the hot paths write, typed as ``Table``, for Core statements.

A statement on a mapped class (``update(Job)``, ``insert(Fact)``, ``select(Page.id)``) run through a
Session is ORM-enabled: it goes through the ORM's compile and result machinery, which costs several
times the Python of the same statement on the table. On a worker's per-page path (claim, checks,
commits, requests, finish) that was most of a small page's CPU (bench/pipeline.py, BENCHMARKS.md).
``Job.__table__`` is typed as a ``FromClause``; these are the same objects, typed for Core use.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table

from models.calibration import CalibrationObservation, CalibrationThreshold
from models.checkpoint import OpCheckpoint
from models.compaction import Compaction, Transcript, TranscriptMessageRow
from models.fact import ExtractionAudit, Fact
from models.job import Job
from models.llm_call import LLMCall
from models.page import Page
from models.webhook import WebhookDelivery

CALIBRATION_OBSERVATIONS = cast(Table, CalibrationObservation.__table__)
CALIBRATION_THRESHOLDS = cast(Table, CalibrationThreshold.__table__)
COMPACTIONS = cast(Table, Compaction.__table__)
EXTRACTION_AUDIT = cast(Table, ExtractionAudit.__table__)
FACTS = cast(Table, Fact.__table__)
JOBS = cast(Table, Job.__table__)
LLM_CALLS = cast(Table, LLMCall.__table__)
OP_CHECKPOINTS = cast(Table, OpCheckpoint.__table__)
PAGES = cast(Table, Page.__table__)
TRANSCRIPTS = cast(Table, Transcript.__table__)
TRANSCRIPT_MESSAGES = cast(Table, TranscriptMessageRow.__table__)
WEBHOOK_DELIVERIES = cast(Table, WebhookDelivery.__table__)
