"""The API's answers as typed models, named as the OpenAPI document names their schemas.

Written by hand to read well, and held to the document by tests/client/test_openapi_drift.py: it walks
every schema below against the live app's ``/openapi.json`` (field names, types, required-ness), so a
server change that is not mirrored here fails the tests. Unknown fields are ignored at run time so an
older client keeps working against a newer server.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    # defer_build: a schema is built on first use, so importing the client (every `factmill` command
    # does, through the demo) costs no model building.
    model_config = ConfigDict(extra="ignore", frozen=True, defer_build=True)


# ---------------------------------------------------------------------------- pages


class JobAccepted(Model):
    job_id: int
    source_id: str
    slug: str
    created: bool  # False: a pending job for this page already existed and will read the new content


class PageRef(Model):
    source_id: str
    slug: str


class PagesAccepted(Model):
    jobs: list[JobAccepted]
    unchanged: list[PageRef]


class PageErased(Model):
    source_id: str
    slug: str
    facts_removed: int
    embeddings_removed: int
    checkpoints_removed: int
    audit_rows_removed: int
    jobs_cancelled: int


class TranscriptErased(Model):
    transcript_id: str
    messages_removed: int
    compactions_removed: int
    jobs_cancelled: int


class PageSummary(Model):
    source_id: str
    slug: str
    type: str
    title: str
    updated_at: datetime
    facts: int
    last_job_id: int | None
    last_job_status: str | None


class PageList(Model):
    pages: list[PageSummary]
    next_after: str | None


# ---------------------------------------------------------------------------- jobs


class JobSpendOut(Model):
    """What a job's LLM calls used and cost (from its llm_calls rows, batch or online)."""

    calls: int
    input_tokens: int  # every prompt token, cached ones included
    cached_tokens: int
    output_tokens: int
    cost_usd: float
    budget_cost_usd: float  # of cost_usd, what its own budget counts (since its budgets last started over)


class JobOut(Model):
    id: int
    kind: str
    subject: str
    source_id: str | None = None
    slug: str | None = None
    status: str
    attempts: int
    worker_losses: int
    provider_outage_since: datetime | None = None  # the LLM provider has served it nothing since then
    pause_reason: str | None = None  # a paused job's: kill_switch, budget, batch, batch_fault
    options: dict[str, Any]
    counters: dict[str, Any]
    last_error: str | None
    rerun_requested: bool
    worker: str | None
    created_at: datetime
    updated_at: datetime
    enqueued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    spend: JobSpendOut | None = None  # get_job only

    @property
    def done(self) -> bool:
        """Succeeded or failed: nothing more will happen to it unless it is retried."""
        return self.status in ("succeeded", "failed")


class JobList(Model):
    jobs: list[JobOut]


# ---------------------------------------------------------------------------- backfills (admin)


class BackfillCreated(Model):
    id: int
    job_id: int


class BackfillSummary(Model):
    id: int
    source_id: str
    filters: dict[str, Any]
    status: str
    cancel_requested: bool
    pages_left_to_others: int  # selected pages an overlapping backfill was extracting: not this one's
    job_id: int | None
    job_status: str | None
    job_note: str | None
    created_by: str | None
    created_at: str
    finished_at: str | None


class BackfillList(Model):
    backfills: list[BackfillSummary]


class BackfillReport(BackfillSummary):
    requests: dict[str, int]
    llm_calls: int
    cost_usd: str
    batches: list[dict[str, Any]]


# ---------------------------------------------------------------------------- facts


class FactRecord(Model):
    id: int
    row_num: int
    fact: str
    kind: str
    entity_slug: str | None
    confidence: float
    notability: str
    context: str
    valid_from: datetime | None
    source: str
    source_session: str
    claim_metric: str | None
    claim_value: float | None
    claim_unit: str | None
    claim_period: str | None
    created_at: datetime
    status: str  # current, superseded or duplicate (the fact lifecycle)
    valid_to: datetime | None
    superseded_by: int | None
    duplicate_of: int | None


class PageFactsPage(Model):
    source_id: str
    slug: str
    page_id: int
    total: int
    facts: list[FactRecord]
    next_after_row_num: int | None = (
        None  # the after_row_num of the next page; None: the last (or an older server)
    )


class EntityFact(FactRecord):
    source_id: str
    source_markdown_slug: str


class EntityFactsPage(Model):
    entity: str
    total: int
    facts: list[EntityFact]
    next_after: str | None = None  # the after of the next page; None: the last (or an older server)


# ---------------------------------------------------------------------------- config


class ConfigOut(Model):
    key: str
    value: str | None
    enabled: bool | None = None
    updated_at: datetime | None = None
    updated_by: str | None = None


class ConfigSetOut(ConfigOut):
    resumed: int = 0


class ConfigList(Model):
    config: list[ConfigOut]
    unread: list[str]


# ---------------------------------------------------------------------------- search


class SearchLineOut(Model):
    type: str
    query: str
    origin: str
    weight: float
    line: int | None
    hits: int


class SearchResultOut(Model):
    fact_id: int
    fact: str
    kind: str
    entity: str | None
    score: float
    lex_score: float | None
    vec_score: float | None
    source_id: str
    page_slug: str
    segment: str
    segment_start: str | None
    segment_end: str | None
    row_num: int
    confidence: float
    notability: str
    valid_from: str | None
    status: str
    valid_to: str | None
    superseded_by: int | None
    duplicate_of: int | None
    snippet: str
    snippet_line: int
    matched_by: list[str]


class SearchOut(Model):
    query: str
    intent: str | None
    structured: bool
    expanded: bool
    strong_signal: bool
    vector_search: str
    searches: list[SearchLineOut]
    results: list[SearchResultOut]
    took_ms: float
    notes: list[str]


# ---------------------------------------------------------------------------- transcripts


class CompactionRequested(Model):
    job_id: int
    created: bool


class AppendOut(Model):
    transcript_id: str
    appended: int
    first_seq: int
    last_seq: int
    context_tokens: int
    trigger_tokens: int | None
    compaction: CompactionRequested | None
    note: str | None = None


class TranscriptSettingsOut(Model):
    context_window: int | None
    reserve_tokens: int
    keep_recent_tokens: int
    tool_result_limit: int
    instructions: str | None


class TranscriptOut(Model):
    transcript_id: str
    settings: TranscriptSettingsOut
    trigger_tokens: int | None
    messages: int
    history_tokens: int
    context_tokens: int
    saved_tokens: int
    summary_tokens: int
    compaction_id: int | None
    cut_seq: int | None
    pending_job_id: int | None
    created_at: datetime | None
    updated_at: datetime | None


class TranscriptSummary(Model):
    transcript_id: str
    context_window: int | None
    messages: int
    history_tokens: int
    updated_at: datetime


class TranscriptList(Model):
    transcripts: list[TranscriptSummary]


class ToolCallOut(Model):
    id: str
    name: str
    arguments: str  # JSON text


class ContextMessageOut(Model):
    seq: int | None
    role: str
    text: str
    tool_calls: list[ToolCallOut]
    tool_call_id: str | None
    tool_name: str | None
    is_compaction: bool
    tokens: int


class ContextOut(Model):
    transcript_id: str
    compaction_id: int | None
    coverage: float | None  # the compaction's measured coverage: what a label of it carries
    cut_seq: int | None
    tokens: int
    messages: list[ContextMessageOut]


class StoredMessageOut(Model):
    seq: int
    role: str
    text: str
    tool_calls: list[ToolCallOut]
    tool_call_id: str | None
    tool_name: str | None
    tokens: int
    created_at: datetime


class MessagesOut(Model):
    transcript_id: str
    messages: list[StoredMessageOut]
    next_after_seq: int | None


class CompactionOut(Model):
    id: int  # the compaction_id record_feedback takes
    transcript_id: str
    status: str  # accepted | rejected | failed
    cut_seq: int
    previous_id: int | None
    summary: str | None
    tokens_before: int
    tokens_after: int | None
    coverage: float | None  # what a label of it carries (record_feedback's coverage)
    density: float | None
    threshold_tau: float | None
    threshold_version: int | None
    attempts: int
    missed_terms: list[str]
    attempt_log: list[dict[str, Any]]
    error: str | None
    job_id: int | None
    created_at: datetime


class CompactionsOut(Model):
    transcript_id: str
    compactions: list[CompactionOut]  # newest first
    next_before_id: int | None = None  # older ones follow: ask again with before_id set to this


# ---------------------------------------------------------------------------- calibration


class FeedbackOut(Model):
    id: int
    duplicate: bool  # this key (or this exact judgement of the compaction) was stored before
    coverage: float
    answer_kept: bool
    origin: str
    compaction_id: int | None
    recompute_job_id: int | None  # set when this observation made a recompute due


class ThresholdOut(Model):
    version: int
    tau: float | None  # None: no threshold was computed (see reason)
    active: bool
    reason: str
    alpha: float
    target_recall: float
    min_observations: int
    n: int
    n_bad: int
    calibration_n: int
    calibration_n_bad: int
    held_out_n: int
    held_out_n_bad: int
    held_out_accepted: int
    held_out_rate: float | None
    split_method: str
    max_observation_id: int | None
    trigger: str
    job_id: int | None
    computed_at: datetime
    activated_at: datetime | None


class ObservationsOut(Model):
    n: int
    kept: int
    lost: int
    since_last_version: int
    last_at: datetime | None


class CalibrationOut(Model):
    tau: float  # what gates use now
    version: int | None  # the active version; None: none is, and tau is the fallback
    fallback: bool
    active: ThresholdOut | None
    observations: ObservationsOut
    history: list[ThresholdOut]  # newest first


# ---------------------------------------------------------------------------- errors


class ErrorOut(Model):
    detail: str


__all__ = [
    "AppendOut",
    "CompactionRequested",
    "ConfigList",
    "ConfigOut",
    "ConfigSetOut",
    "ContextMessageOut",
    "ContextOut",
    "EntityFact",
    "EntityFactsPage",
    "ErrorOut",
    "FactRecord",
    "JobAccepted",
    "JobList",
    "JobOut",
    "JobSpendOut",
    "MessagesOut",
    "Model",
    "PageErased",
    "PageFactsPage",
    "PageList",
    "PageRef",
    "PageSummary",
    "PagesAccepted",
    "SearchLineOut",
    "SearchOut",
    "SearchResultOut",
    "StoredMessageOut",
    "ToolCallOut",
    "TranscriptErased",
    "TranscriptList",
    "TranscriptOut",
    "TranscriptSettingsOut",
    "TranscriptSummary",
]
