"""Extraction runs over the store: pages → segments → LLM → facts, resumable and exactly-once per segment."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from itertools import islice
from typing import Any, Protocol

from sqlalchemy import Table, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from models import Fact, OpCheckpoint, Page
from worker.accounting import Budget, Ledger, Price, cost_usd
from worker.config_store import EXTRACTION_ENABLED, EXTRACTION_MAX_FACTS, EXTRACTION_PAGE_TYPES, ConfigReader
from worker.core.conversation import (
    MAX_PAGE_BODY_BYTES,
    Message,
    Segment,
    parse_conversation_messages,
    render_segment_for_extraction,
    split_into_segments,
)
from worker.core.facts import (
    ExtractedFact,
    MalformedReplyError,
    extraction_system_prompt,
    facts_json_schema,
    parse_facts_reply,
    repair_user_message,
    segment_user_message,
)
from worker.jobs.registry import KillSwitchOffError
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.retry import AttemptRecord
from worker.llm.types import ChatRequest, ChatResponse, LLMClient, Usage

logger = logging.getLogger(__name__)

OP_NAME = "extract-conversation-facts"
PER_SEGMENT_SOURCE_PREFIX = "cli:extract-conversation-facts"
TERMINAL_AUDIT_SOURCE = "cli:extract-conversation-facts:terminal"
TERMINAL_AUDIT_FACT = "EXTRACTION_COMPLETE"
TERMINAL_ROW_NUM = -1
CONVERSATION_PAGE_TYPES = ("conversation", "meeting", "slack", "email", "imessage")
LLM_PURPOSE = "extraction"
# A truncated reply is retried once with this many times the output cap, up to the ceiling.
TRUNCATION_RETRY_FACTOR = 2
MAX_OUTPUT_TOKENS_CEILING = 8192


class ExtractionDisabledError(KillSwitchOffError):
    """The kill switch is off; nothing was sent to the LLM."""

    def __init__(self) -> None:
        super().__init__(
            f"fact extraction is disabled ({EXTRACTION_ENABLED}=false). Turn it on with "
            f"`factmill config set {EXTRACTION_ENABLED} true`, or pass --override-disabled "
            "(override_disabled=True) for a one-off run."
        )


# ---------------------------------------------------------------------------
# Fingerprint and checkpoint entries (the seed's contract).
# ---------------------------------------------------------------------------


def extract_conversation_facts_fingerprint(source_id: str) -> str:
    """First 8 hex digits of sha256 of ``{"sourceId":"<id>"}``: one resume namespace per source."""
    payload = json.dumps({"sourceId": source_id}, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True)
class CheckpointEntry:
    source_id: str
    slug: str
    end_iso: str


def encode_checkpoint_entry(source_id: str, slug: str, end_iso: str) -> str:
    """``sourceId|slug|endIso``; the slug may hold ``/`` and even ``|``, the other two may not."""
    if "|" in source_id or "|" in end_iso:
        raise ValueError(f"source_id and end_iso must not contain '|': {source_id!r}, {end_iso!r}")
    return f"{source_id}|{slug}|{end_iso}"


def decode_checkpoint_entry(entry: str) -> CheckpointEntry | None:
    """The entry's parts, or None when it is not of the form ``sourceId|slug|endIso``."""
    source_id, sep, rest = entry.partition("|")
    slug, sep2, end_iso = rest.rpartition("|")
    if not sep or not sep2 or not source_id or not slug or not end_iso:
        return None
    return CheckpointEntry(source_id=source_id, slug=slug, end_iso=end_iso)


def _page_key(source_id: str, slug: str) -> str:
    return f"{source_id}|{slug}"


class PrefixHasher:
    """sha256 over a growing prefix of the messages: digest(k) costs only the messages added since the
    last call, so checkpointing every segment of a long page stays linear, not quadratic."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self._messages = messages
        self._digest = hashlib.sha256()
        self._done = 0

    def digest(self, count: int) -> str:
        if count < self._done:  # going back (an edited page): start over
            self._digest, self._done = hashlib.sha256(), 0
        update = self._digest.update
        for message in self._messages[self._done : count]:
            for part in (message.speaker, message.timestamp, message.text):
                update(part.encode("utf-8", "surrogatepass"))
                update(b"\x1f")
            update(b"\x1e")
        self._done = count
        return self._digest.copy().hexdigest()


def messages_hash(messages: Sequence[Message]) -> str:
    """A digest of the messages already extracted, to tell an append from an edit."""
    return PrefixHasher(messages).digest(len(messages))


# ---------------------------------------------------------------------------
# Options, counters, reports.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractOptions:
    source_id: str = "default"
    slug: str | None = None
    dry_run: bool = False
    force: bool = False
    since_iso: str | None = None
    override_disabled: bool = False
    max_facts: int | None = None  # None: config extraction.max_facts, else 10
    max_output_tokens: int = 1024
    job_id: int | None = None
    segment_concurrency: int = 1  # LLM calls in flight per page; results still commit in order


@dataclass
class PageReport:
    slug: str
    status: str  # processed | skipped | skipped_too_large | failed | dry_run | incomplete (batch mode)
    reason: str = ""
    segments: int = 0
    facts: int = 0
    outcome: str | None = None  # for a failed page: the outcome of the segment that failed


@dataclass
class ExtractionCounters:
    pages_considered: int = 0
    pages_processed: int = 0
    pages_skipped: int = 0
    pages_skipped_too_large: int = 0
    pages_failed: int = 0
    segments_processed: int = 0
    segments_failed: int = 0
    facts_extracted: int = 0
    facts_inserted: int = 0
    llm_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    pages: list[PageReport] = field(default_factory=list)

    def as_dict(self, with_pages: bool = True) -> dict[str, Any]:
        data = asdict(self)
        if not with_pages:
            data.pop("pages")
        return data


class ExtractionProgress(Protocol):
    def pages_listed(self, count: int) -> None: ...
    def page_started(self, slug: str, segments: int) -> None: ...
    def segment_finished(self, slug: str, outcome: str) -> None: ...
    def page_finished(self, report: PageReport) -> None: ...


class _NoProgress:
    def pages_listed(self, count: int) -> None:
        pass

    def page_started(self, slug: str, segments: int) -> None:
        pass

    def segment_finished(self, slug: str, outcome: str) -> None:
        pass

    def page_finished(self, report: PageReport) -> None:
        pass


# ---------------------------------------------------------------------------
# One segment: LLM attempts with repair/retry, never "0 facts" on failure.
# ---------------------------------------------------------------------------


@dataclass
class Attempt:
    outcome: str
    response: ChatResponse | None
    facts: list[ExtractedFact]
    error: str | None = None
    provider: str = ""
    model: str = ""
    latency_ms: int = 0
    called: bool = True  # False: refused before any request (budget), so no llm_calls row
    batch: bool = False  # answered through a provider's batch API: billed at the batch discount

    @classmethod
    def of(
        cls,
        response: ChatResponse,
        outcome: str,
        *,
        facts: list[ExtractedFact] | None = None,
        error: str | None = None,
    ) -> Attempt:
        return cls(
            outcome, response, facts or [], error, response.provider, response.model, response.latency_ms
        )


@dataclass
class SegmentResult:
    attempts: list[Attempt]

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].outcome == "ok"

    @property
    def facts(self) -> list[ExtractedFact]:
        return self.attempts[-1].facts if self.ok else []

    @property
    def outcome(self) -> str:
        return self.attempts[-1].outcome


def _retried_failures(records: Sequence[AttemptRecord]) -> list[Attempt]:
    """The gateway's failed tries (429, 5xx, timeouts it retried) as attempts: each cost a request and is
    recorded in llm_calls and extraction_audit like any other."""
    return [
        Attempt("provider_error", None, [], str(r.error), r.provider, r.model, r.latency_ms)
        for r in records
        if r.error is not None
    ]


def _chat_recording_retries(llm: LLMClient, request: ChatRequest, attempts: list[Attempt]) -> ChatResponse:
    traced = getattr(llm, "chat_traced", None)
    if traced is None:
        return llm.chat(request)
    result = traced(request)
    attempts.extend(_retried_failures(result.failed_attempts))
    return result.value  # type: ignore[no-any-return]


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


def classify_reply(response: ChatResponse, max_facts: int, cap: int) -> Attempt:
    """One reply as an attempt: refusal, truncated_output, malformed_output, or ok with its facts."""
    if response.finish == "refusal":
        return Attempt.of(response, "refusal", error=response.refusal or "the model refused")
    if response.finish == "truncated":
        return Attempt.of(response, "truncated_output", error=f"output hit the {cap}-token cap")
    try:
        facts = parse_facts_reply(response.text, max_facts)
    except MalformedReplyError as exc:
        return Attempt.of(response, "malformed_output", error=str(exc))
    return Attempt.of(response, "ok", facts=facts)


def extract_segment(
    llm: LLMClient,
    rendered: str,
    max_facts: int,
    max_output_tokens: int,
    before_call: Callable[[], None] | None = None,
) -> SegmentResult:
    """Ask for facts; one repair turn for a malformed reply, one bigger cap for a truncated one."""
    turns: list[tuple[str, str]] = [("user", segment_user_message(rendered))]
    cap = max_output_tokens
    attempts: list[Attempt] = []
    repaired = retried_truncation = False
    while True:
        request = extraction_request(turns, max_facts, cap)
        try:
            if before_call is not None:
                before_call()
        except BudgetExhaustedError as exc:
            attempts.append(
                Attempt("budget_exhausted", None, [], str(exc), llm.provider, llm.model, called=False)
            )
            return SegmentResult(attempts)
        try:
            response = _chat_recording_retries(llm, request, attempts)
        except BudgetExhaustedError as exc:  # refused by a budget check inside the client: no request made
            attempts.append(
                Attempt("budget_exhausted", None, [], str(exc), llm.provider, llm.model, called=False)
            )
            return SegmentResult(attempts)
        except LLMError as exc:
            attempts.extend(_retried_failures(getattr(exc, "attempts", ())[:-1]))
            attempts.append(
                Attempt("provider_error", None, [], str(exc), llm.provider, llm.model, exc.latency_ms)
            )
            return SegmentResult(attempts)
        attempt = classify_reply(response, max_facts, cap)
        attempts.append(attempt)
        if attempt.outcome == "truncated_output":
            if retried_truncation or cap >= MAX_OUTPUT_TOKENS_CEILING:
                return SegmentResult(attempts)
            retried_truncation = True
            cap = min(cap * TRUNCATION_RETRY_FACTOR, MAX_OUTPUT_TOKENS_CEILING)
            continue
        if attempt.outcome == "malformed_output":
            if repaired:
                return SegmentResult(attempts)
            repaired = True
            turns = [
                *turns,
                ("assistant", response.text),
                ("user", repair_user_message(response.text, attempt.error or "")),
            ]
            continue
        return SegmentResult(attempts)


# ---------------------------------------------------------------------------
# Writing: one transaction per segment (facts + audit + llm_calls + checkpoint).
# ---------------------------------------------------------------------------


class CheckpointConflictError(RuntimeError):
    """Another run advanced this page's checkpoint first; this run's segment was rolled back."""


def _iso_to_datetime(iso: str) -> datetime | None:
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None


def _segment_context(segment: Segment) -> str:
    return f"conversation segment {segment.start_iso} to {segment.end_iso}"


# One round trip per attempt: the llm_calls row and the extraction_audit row that points at it.
_INSERT_ATTEMPT = text(
    """
    WITH call AS (
        INSERT INTO llm_calls (job_id, provider, model, purpose, input_tokens, output_tokens,
                               cache_read_tokens, cache_write_tokens, latency_ms, outcome, cost_usd, error)
        VALUES (:job_id, :provider, :model, :purpose, :input_tokens, :output_tokens,
                :cache_read_tokens, :cache_write_tokens, :latency_ms, :outcome, :cost_usd, :error)
        RETURNING id
    )
    INSERT INTO extraction_audit (job_id, source_id, page_slug, segment_index, segment_start, segment_end,
                                  attempt, outcome, facts_count, error, llm_call_id)
    SELECT :job_id, :source_id, :page_slug, :segment_index, :segment_start, :segment_end,
           :attempt, :outcome, :facts_count, :error, call.id
    FROM call
    """
)
# An attempt refused before any request (budget exhausted) has an audit row but no llm_calls row.
_INSERT_AUDIT_ONLY = text(
    """
    INSERT INTO extraction_audit (job_id, source_id, page_slug, segment_index, segment_start, segment_end,
                                  attempt, outcome, facts_count, error)
    VALUES (:job_id, :source_id, :page_slug, :segment_index, :segment_start, :segment_end,
            :attempt, :outcome, :facts_count, :error)
    """
)


def _write_attempts(
    session: Session,
    attempts: Sequence[Attempt],
    *,
    options: ExtractOptions,
    slug: str,
    index: int,
    segment: Segment,
    note: str | None = None,
    prices: dict[str, Price] | None = None,
) -> None:
    for number, attempt in enumerate(attempts, start=1):
        usage = attempt.response.usage if attempt.response else Usage()
        session.execute(
            _INSERT_ATTEMPT if attempt.called else _INSERT_AUDIT_ONLY,
            {
                "job_id": options.job_id,
                "provider": attempt.provider,
                "model": attempt.model,
                "purpose": LLM_PURPOSE,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "cache_read_tokens": usage.cache_read_tokens,
                "cache_write_tokens": usage.cache_write_tokens,
                "latency_ms": attempt.latency_ms,
                "outcome": attempt.outcome,
                "cost_usd": cost_usd(attempt.model, usage, prices, batch=attempt.batch),
                "error": "; ".join(part for part in (attempt.error, note) if part) or None,
                "source_id": options.source_id,
                "page_slug": slug,
                "segment_index": index,
                "segment_start": segment.start_iso,
                "segment_end": segment.end_iso,
                "attempt": number,
                "facts_count": len(attempt.facts),
            },
        )


def _fact_rows(
    facts: Sequence[ExtractedFact], *, source_id: str, slug: str, segment: Segment, first_row: int
) -> list[dict[str, Any]]:
    valid_from = _iso_to_datetime(segment.start_iso)
    context = _segment_context(segment)
    return [
        {
            "source_id": source_id,
            "fact": f.fact,
            "kind": f.kind,
            "entity_slug": f.entity,
            "confidence": f.confidence,
            "notability": f.notability,
            "context": context,
            "valid_from": valid_from,
            "source": PER_SEGMENT_SOURCE_PREFIX,
            "source_session": f"{PER_SEGMENT_SOURCE_PREFIX}:{slug}",
            "source_markdown_slug": slug,
            "row_num": first_row + offset,
            "is_audit": False,
            "claim_metric": f.metric,
            "claim_value": f.value,
            "claim_unit": f.unit,
            "claim_period": f.period,
        }
        for offset, f in enumerate(facts)
    ]


_FACTS: Table = Fact.__table__  # type: ignore[assignment]
# One statement object, so SQLAlchemy compiles it once; rows go in executemany form (one round trip).
_INSERT_FACTS = (
    insert(_FACTS)
    .on_conflict_do_nothing(
        index_elements=[_FACTS.c.source_id, _FACTS.c.source_markdown_slug, _FACTS.c.row_num]
    )
    .returning(_FACTS.c.row_num)
)


def _insert_facts(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert a segment's facts; returns how many went in (SQLAlchemy gives no INSERT rowcount here)."""
    if not rows:
        return 0
    return len(session.execute(_INSERT_FACTS, rows).all())


def _terminal_row(source_id: str, slug: str) -> dict[str, Any]:
    return {
        "source_id": source_id,
        "fact": TERMINAL_AUDIT_FACT,
        "kind": "fact",
        "entity_slug": None,
        "confidence": 1.0,
        "notability": "low",
        "context": "",
        "valid_from": None,
        "source": TERMINAL_AUDIT_SOURCE,
        "source_session": f"{TERMINAL_AUDIT_SOURCE}:{slug}",
        "source_markdown_slug": slug,
        "row_num": TERMINAL_ROW_NUM,
        "is_audit": True,
    }


def _upsert_terminal(session: Session, source_id: str, slug: str) -> None:
    stmt = insert(Fact).values(_terminal_row(source_id, slug))
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[Fact.source_id, Fact.source_markdown_slug, Fact.row_num],
            set_={"created_at": func.now()},
        )
    )


def _delete_terminal(session: Session, source_id: str, slug: str) -> None:
    session.execute(
        delete(Fact).where(
            Fact.source_id == source_id,
            Fact.source_markdown_slug == slug,
            Fact.row_num == TERMINAL_ROW_NUM,
        )
    )


@dataclass(frozen=True)
class _Progress:
    """Where a page's checkpoint stands (None: never extracted)."""

    messages_done: int
    prefix_hash: str
    next_row_num: int


@dataclass(frozen=True)
class PagePlan:
    """One page's pending work: the segments after its checkpoint, and how to commit them."""

    page_id: int
    slug: str
    label: str
    hasher: PrefixHasher
    segments: Sequence[Segment]
    ends: Sequence[int]  # per segment, the message index just past it (the checkpoint it advances to)
    checkpoint: _Progress | None
    replace: bool  # force, or an edited page: all segments must succeed, then the facts are swapped


def _advance_checkpoint(
    session: Session,
    *,
    fingerprint: str,
    options: ExtractOptions,
    slug: str,
    expected: _Progress | None,
    new: _Progress,
    end_iso: str,
) -> None:
    """Move the checkpoint from ``expected`` to ``new`` or raise: the guard against two runs on one page."""
    key = _page_key(options.source_id, slug)
    values = {
        "completed_key": encode_checkpoint_entry(options.source_id, slug, end_iso),
        "messages_done": new.messages_done,
        "prefix_hash": new.prefix_hash,
        "next_row_num": new.next_row_num,
    }
    table: Table = OpCheckpoint.__table__  # type: ignore[assignment]
    if expected is None:
        inserted = session.execute(
            insert(table)
            .values(op=OP_NAME, fingerprint=fingerprint, page_key=key, **values)
            .on_conflict_do_nothing()
            .returning(table.c.op)
        )
        moved = len(inserted.all())  # SQLAlchemy reports no rowcount for INSERT here
    else:
        updated = session.execute(
            update(table)
            .where(
                table.c.op == OP_NAME,
                table.c.fingerprint == fingerprint,
                table.c.page_key == key,
                table.c.messages_done == expected.messages_done,
                table.c.prefix_hash == expected.prefix_hash,
                table.c.next_row_num == expected.next_row_num,
            )
            .values(**values, updated_at=func.now())
        )
        moved = updated.rowcount  # type: ignore[attr-defined]
    if moved != 1:
        raise CheckpointConflictError(f"another run advanced the checkpoint of {slug!r} first")


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------


def _page_types(config: ConfigReader) -> tuple[str, ...]:
    narrowed = config.get(EXTRACTION_PAGE_TYPES)
    if not narrowed or not narrowed.strip():
        return CONVERSATION_PAGE_TYPES
    wanted = {t.strip().lower() for t in narrowed.split(",") if t.strip()}
    return tuple(t for t in CONVERSATION_PAGE_TYPES if t in wanted)


def _max_facts(options: ExtractOptions, config: ConfigReader) -> int:
    if options.max_facts is not None:
        value = options.max_facts
    else:
        raw = config.get(EXTRACTION_MAX_FACTS)
        value = int(raw) if raw and raw.strip().isdigit() else 10
    if not 1 <= value <= 25:
        raise ValueError(f"max_facts must be between 1 and 25, got {value}")
    return value


def _validate_since(since_iso: str | None) -> None:
    if since_iso is not None and _iso_to_datetime(since_iso) is None:
        raise ValueError(f"--since must be an ISO-8601 time such as 2024-03-15T00:00:00Z, got {since_iso!r}")


def _segment_ends(messages: Sequence[Message], start: int, segments: Sequence[Segment]) -> list[int]:
    """For each segment, the index just past its last message in ``messages``."""
    ends: list[int] = []
    cursor = start
    for segment in segments:
        last = segment.messages[-1]
        while messages[cursor] is not last:
            cursor += 1
        cursor += 1
        ends.append(cursor)
    return ends


class _Run:
    def __init__(
        self,
        factory: sessionmaker[Session],
        llm: LLMClient | None,
        options: ExtractOptions,
        config: ConfigReader,
        progress: ExtractionProgress,
        guard: Callable[[], None] | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.factory = factory
        self.guard = guard
        self.budget = budget or Budget(factory, config.get)
        self.prices = Ledger(config.get).prices()
        self.llm = llm
        self.options = options
        self.config = config
        self.progress = progress
        self.counters = ExtractionCounters()
        self.fingerprint = extract_conversation_facts_fingerprint(options.source_id)
        self.max_facts = _max_facts(options, config)

    def check_switch(self) -> None:
        if not self.options.override_disabled and not self.config.enabled(EXTRACTION_ENABLED):
            raise ExtractionDisabledError()

    def list_pages(self) -> list[tuple[int, str, int]]:
        types = _page_types(self.config)
        size = func.octet_length(Page.compiled_truth) + func.octet_length(Page.timeline)
        query = select(Page.id, Page.slug, size).where(
            Page.source_id == self.options.source_id, Page.type.in_(types)
        )
        if self.options.slug is not None:
            query = query.where(Page.slug == self.options.slug)
        with self.factory() as session:
            return [(row[0], row[1], int(row[2])) for row in session.execute(query.order_by(Page.slug))]

    def finish(self, report: PageReport) -> None:
        c = self.counters
        if report.status in ("processed", "dry_run"):
            c.pages_processed += 1
        elif report.status == "skipped":
            c.pages_skipped += 1
        elif report.status == "skipped_too_large":
            c.pages_skipped_too_large += 1
        else:
            c.pages_failed += 1
        c.pages.append(report)
        self.progress.page_finished(report)

    def run(self) -> ExtractionCounters:
        _validate_since(self.options.since_iso)
        if not self.options.dry_run:
            self.check_switch()
            if self.llm is None:
                raise ValueError("an LLM client is required unless dry_run is set")
        pages = self.list_pages()
        self.counters.pages_considered = len(pages)
        self.progress.pages_listed(len(pages))
        for page_id, slug, size in pages:
            plan = self.plan_page(page_id, slug, size)
            if isinstance(plan, PageReport):
                self.finish(plan)
                continue
            self.finish(self.commit_page(plan, self.ordered_results(plan.slug, plan.label, plan.segments)))
        return self.counters

    def load_checkpoint(self, session: Session, slug: str) -> _Progress | None:
        row = session.get(OpCheckpoint, (OP_NAME, self.fingerprint, _page_key(self.options.source_id, slug)))
        if row is None:
            return None
        return _Progress(row.messages_done, row.prefix_hash, row.next_row_num)

    def commit_page(
        self, plan: PagePlan, results: Generator[tuple[int, Segment, SegmentResult], None, None]
    ) -> PageReport:
        """Commit a planned page's segment results (in page order) through the per-segment transaction."""
        self.progress.page_started(plan.slug, len(plan.segments))
        if plan.replace:
            return self.extract_replacing(plan.slug, plan.hasher, plan.segments, plan.ends, results)
        return self.extract_incremental(
            plan.slug, plan.hasher, plan.segments, plan.ends, plan.checkpoint, results
        )

    def plan_page(self, page_id: int, slug: str, size: int) -> PagePlan | PageReport:
        """The page's segments after its checkpoint, or a report saying why there is nothing to do."""
        if size > MAX_PAGE_BODY_BYTES:
            return PageReport(
                slug, "skipped_too_large", f"body is {size} bytes, over the {MAX_PAGE_BODY_BYTES}-byte cap"
            )
        with self.factory() as session:
            page = session.get(Page, page_id)
            if page is None:
                return PageReport(slug, "skipped", "the page was deleted before it could be extracted")
            body = page.compiled_truth + ("\n" + page.timeline if page.timeline else "")
            label = f"{page.type}: {page.title}" if page.title else slug
            checkpoint = None if self.options.force else self.load_checkpoint(session, slug)
        messages = parse_conversation_messages(body)
        hasher = PrefixHasher(messages)
        del body
        if not messages:
            return PageReport(
                slug, "skipped", "no message lines (expected **Name** (YYYY-MM-DD H:MM AM): text)"
            )
        replace = self.options.force
        start = 0
        if checkpoint is not None:
            done = checkpoint.messages_done
            if done <= len(messages) and hasher.digest(done) == checkpoint.prefix_hash:
                start = done
            else:
                replace = True  # messages already extracted were edited: re-extract the whole page
        segments = split_into_segments(messages[start:], since_iso=self.options.since_iso)
        if not segments:
            return PageReport(slug, "skipped", "nothing new since the last extraction")
        ends = _segment_ends(messages, start, segments)
        if self.options.dry_run:
            self.counters.segments_processed += len(segments)
            return PageReport(slug, "dry_run", "", segments=len(segments))
        return PagePlan(page_id, slug, label, hasher, segments, ends, checkpoint, replace)

    def call(self, label: str, segment: Segment) -> SegmentResult:
        """One segment's LLM attempts; runs on pool threads, so it touches no shared state."""
        self.check_switch()
        if self.guard is not None:
            self.guard()
        assert self.llm is not None
        return extract_segment(
            self.llm,
            render_segment_for_extraction(label, segment),
            self.max_facts,
            self.options.max_output_tokens,
            before_call=lambda: self.budget.check(self.options.job_id),
        )

    def count_calls(self, result: SegmentResult) -> None:
        c = self.counters
        c.llm_calls += sum(attempt.called for attempt in result.attempts)
        for attempt in result.attempts:
            if attempt.response is not None:
                c.input_tokens += attempt.response.usage.input_tokens
                c.output_tokens += attempt.response.usage.output_tokens

    def ordered_results(
        self, slug: str, label: str, segments: Sequence[Segment]
    ) -> Generator[tuple[int, Segment, SegmentResult], None, None]:
        """Segment results in page order, with up to ``segment_concurrency`` LLM calls in flight.

        Committing strictly in order keeps the checkpoint monotonic. When the consumer stops
        early (a failed segment, the kill switch), calls already in flight still finish and are
        recorded (they cost money) but their facts are discarded; calls not yet started never are.
        """
        width = max(1, self.options.segment_concurrency)
        if width == 1:
            for index, segment in enumerate(segments):
                result = self.call(label, segment)
                self.count_calls(result)
                yield index, segment, result
            return
        pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="segment")
        pending: deque[tuple[int, Segment, Future[SegmentResult]]] = deque()
        upcoming = iter(enumerate(segments))
        try:
            for index, segment in islice(upcoming, width):
                pending.append((index, segment, pool.submit(self.call, label, segment)))
            while pending:
                index, segment, future = pending.popleft()
                result = future.result()
                self.count_calls(result)
                yield index, segment, result
                for next_index, next_segment in islice(upcoming, 1):
                    pending.append((next_index, next_segment, pool.submit(self.call, label, next_segment)))
        finally:
            for _, _, future in pending:
                future.cancel()
            pool.shutdown(wait=True)
            for index, segment, future in pending:
                if future.cancelled() or future.exception() is not None:
                    continue
                result = future.result()
                self.count_calls(result)
                with self.factory.begin() as session:
                    _write_attempts(
                        session,
                        result.attempts,
                        options=self.options,
                        slug=slug,
                        index=index,
                        segment=segment,
                        prices=self.prices,
                        note="discarded: an earlier segment did not complete",
                    )

    def extract_incremental(
        self,
        slug: str,
        hasher: PrefixHasher,
        segments: Sequence[Segment],
        ends: Sequence[int],
        checkpoint: _Progress | None,
        results: Generator[tuple[int, Segment, SegmentResult], None, None],
    ) -> PageReport:
        """Commit results as they come, one transaction each; if they end early the rest wait for later."""
        report = PageReport(slug, "processed")
        expected = checkpoint
        next_row = checkpoint.next_row_num if checkpoint else 0
        try:
            for index, segment, result in results:
                end = ends[index]
                with self.factory.begin() as session:
                    _write_attempts(
                        session,
                        result.attempts,
                        options=self.options,
                        slug=slug,
                        index=index,
                        segment=segment,
                        prices=self.prices,
                    )
                    if not result.ok:
                        self.counters.segments_failed += 1
                        self.progress.segment_finished(slug, result.outcome)
                        report.status, report.outcome = "failed", result.outcome
                        report.reason = (
                            f"segment {index + 1}: {result.outcome}: {result.attempts[-1].error or ''}"
                        )
                        return report
                    rows = _fact_rows(
                        result.facts,
                        source_id=self.options.source_id,
                        slug=slug,
                        segment=segment,
                        first_row=next_row,
                    )
                    inserted = _insert_facts(session, rows)
                    new = _Progress(end, hasher.digest(end), next_row + len(rows))
                    _advance_checkpoint(
                        session,
                        fingerprint=self.fingerprint,
                        options=self.options,
                        slug=slug,
                        expected=expected,
                        new=new,
                        end_iso=segment.end_iso,
                    )
                    if index == len(segments) - 1:
                        _upsert_terminal(session, self.options.source_id, slug)
                    elif index == 0 and checkpoint is not None:
                        # Appended messages: the page is incomplete again until its last new segment.
                        _delete_terminal(session, self.options.source_id, slug)
                expected, next_row = new, new.next_row_num
                self.counters.segments_processed += 1
                self.counters.facts_extracted += len(result.facts)
                self.counters.facts_inserted += inserted
                report.segments += 1
                report.facts += inserted
                self.progress.segment_finished(slug, "ok")
        finally:
            results.close()
        return report

    def extract_replacing(
        self,
        slug: str,
        hasher: PrefixHasher,
        segments: Sequence[Segment],
        ends: Sequence[int],
        results: Generator[tuple[int, Segment, SegmentResult], None, None],
    ) -> PageReport:
        """Re-extract the page and swap its facts in one transaction, only if every segment succeeded."""
        report = PageReport(slug, "processed")
        all_rows: list[dict[str, Any]] = []
        extracted = 0
        try:
            for index, segment, result in results:
                with self.factory.begin() as session:
                    _write_attempts(
                        session,
                        result.attempts,
                        options=self.options,
                        slug=slug,
                        index=index,
                        segment=segment,
                        prices=self.prices,
                    )
                self.progress.segment_finished(slug, result.outcome)
                if not result.ok:
                    self.counters.segments_failed += 1
                    report.status, report.outcome = "failed", result.outcome
                    report.reason = (
                        f"segment {index + 1}: {result.outcome}: {result.attempts[-1].error or ''}; "
                        "the page's earlier facts were kept"
                    )
                    return report
                all_rows += _fact_rows(
                    result.facts,
                    source_id=self.options.source_id,
                    slug=slug,
                    segment=segment,
                    first_row=len(all_rows),
                )
                extracted += len(result.facts)
                report.segments += 1
        finally:
            results.close()
        if report.segments < len(segments):
            # The results ran out (a batch that expired): swapping now would drop the page's later facts.
            report.status = "incomplete"
            report.reason = (
                f"{len(segments) - report.segments} segment(s) had no result; the earlier facts were kept"
            )
            return report
        with self.factory.begin() as session:
            # Lock this page's checkpoint row (if any) so a concurrent run cannot interleave with the swap.
            current = session.execute(
                select(OpCheckpoint)
                .where(
                    OpCheckpoint.op == OP_NAME,
                    OpCheckpoint.fingerprint == self.fingerprint,
                    OpCheckpoint.page_key == _page_key(self.options.source_id, slug),
                )
                .with_for_update()
            ).scalar_one_or_none()
            session.execute(
                delete(Fact).where(
                    Fact.source_id == self.options.source_id,
                    Fact.source_markdown_slug == slug,
                    Fact.source.in_((PER_SEGMENT_SOURCE_PREFIX, TERMINAL_AUDIT_SOURCE)),
                )
            )
            inserted = 0
            for chunk_start in range(0, len(all_rows), 1000):
                inserted += _insert_facts(session, all_rows[chunk_start : chunk_start + 1000])
            expected = None
            if current is not None:
                expected = _Progress(current.messages_done, current.prefix_hash, current.next_row_num)
            end = ends[-1]
            new = _Progress(end, hasher.digest(end), len(all_rows))
            _advance_checkpoint(
                session,
                fingerprint=self.fingerprint,
                options=self.options,
                slug=slug,
                expected=expected,
                new=new,
                end_iso=segments[-1].end_iso,
            )
            _upsert_terminal(session, self.options.source_id, slug)
        self.counters.segments_processed += len(segments)
        self.counters.facts_extracted += extracted
        self.counters.facts_inserted += inserted
        report.facts = inserted
        return report


def run_extract_conversation_facts(
    factory: sessionmaker[Session],
    llm: LLMClient | None,
    options: ExtractOptions | None = None,
    *,
    config: ConfigReader | None = None,
    progress: ExtractionProgress | None = None,
    guard: Callable[[], None] | None = None,
    budget: Budget | None = None,
) -> ExtractionCounters:
    """Extract facts from the conversation pages of one source (or one page), resuming from checkpoints.

    Raises ExtractionDisabledError when the kill switch is off (unless ``override_disabled``),
    ValueError on bad options, and whatever ``guard`` raises (it is called before every LLM call,
    e.g. to stop a job whose lease was lost). Per-page problems never raise: they are counted and reported.
    """
    options = options or ExtractOptions()
    config = config or ConfigReader(factory, ttl=2.0)
    return _Run(factory, llm, options, config, progress or _NoProgress(), guard, budget).run()
