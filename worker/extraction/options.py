"""The vocabulary of an extraction run: its constants, options, errors, counters, reports and progress."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from worker.config_store import (
    EXTRACTION_ENABLED,
    EXTRACTION_MAX_FACTS,
    EXTRACTION_MAX_SEGMENT_FAILURES,
    EXTRACTION_PAGE_TYPES,
    MAX_SEGMENT_FAILURES_CEILING,
    ConfigReader,
    stored_count,
)
from worker.core.conversation import check_page_types, instant_micros, narrow_page_types
from worker.core.facts import DEFAULT_MAX_FACTS, MAX_FACTS_LIMIT
from worker.extraction.segments import SegmentResult
from worker.jobs.registry import KillSwitchOffError

logger = logging.getLogger(__name__)

OP_NAME = "extract-conversation-facts"
PER_SEGMENT_SOURCE_PREFIX = "cli:extract-conversation-facts"
TERMINAL_AUDIT_SOURCE = "cli:extract-conversation-facts:terminal"
DEFAULT_MAX_SEGMENT_FAILURES = 3


class ExtractionDisabledError(KillSwitchOffError):
    """The kill switch is off; nothing was sent to the LLM."""

    def __init__(self) -> None:
        super().__init__(
            f"fact extraction is disabled ({EXTRACTION_ENABLED}=false). Turn it on with "
            f"`factmill config set {EXTRACTION_ENABLED} true`, or pass --override-disabled "
            "(override_disabled=True) for a one-off run."
        )


class CheckpointConflictError(RuntimeError):
    """Another run advanced this page's checkpoint first; this run's segment was rolled back."""


class PageChangedError(CheckpointConflictError):
    """The page was erased, emptied or edited while it was extracted; this run's segment was rolled back
    (a conflict like any other: the job is retried, and the retry plans the page as it is now)."""


class PageErasedError(PageChangedError):
    """The page was erased while it was extracted: the calls its refused commit paid for are recorded
    without a provider's message (it may quote the page, and the erasure has run: nothing else takes it
    out of a call made under no job of the page's, a CLI run's or a backfill's)."""


@dataclass(frozen=True)
class ExtractOptions:
    source_id: str = "default"
    slug: str | None = None
    dry_run: bool = False
    force: bool = False
    since_iso: str | None = None
    override_disabled: bool = False
    max_facts: int | None = None  # None: config extraction.max_facts, else default_max_facts
    default_max_facts: int = DEFAULT_MAX_FACTS  # FACTMILL_EXTRACTION_MAX_FACTS
    max_output_tokens: int = 1024
    job_id: int | None = None
    segment_concurrency: int = 1  # LLM calls in flight per page; results still commit in order
    retry_skipped: bool = False  # first re-extract the page's skipped (poison) segments, in page order


@dataclass
class PageReport:
    slug: str
    status: str  # processed | skipped | skipped_too_large | failed | dry_run | incomplete (batch mode)
    reason: str = ""
    segments: int = 0
    facts: int = 0
    outcome: str | None = None  # for a failed page: the outcome of the segment that failed
    skipped: int = 0  # poison segments the page went past (their facts are missing)
    # The failed segment's provider was away (retryable errors past the retry layer's wait): not the
    # page's fault, so the job waits the outage out (worker.jobs.outages), spending no attempt.
    provider_away: bool = False
    # Segments of a page re-extracted whole that were answered (ok or skipped) and held for its swap,
    # which did not come: answered this run, kept by none (worker.extraction.job: the outage clock).
    held: int = 0


@dataclass
class ExtractionCounters:
    pages_considered: int = 0
    pages_processed: int = 0
    pages_skipped: int = 0
    pages_skipped_too_large: int = 0
    pages_failed: int = 0
    segments_processed: int = 0
    segments_failed: int = 0
    segments_skipped: int = 0  # poison segments skipped by this run (skipped is never "0 facts")
    segments_unskipped: int = 0  # skipped segments a `--skipped` retry extracted
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

    def add_page(self, report: PageReport) -> None:
        """Count one finished page by its status and keep its report."""
        if report.status == "dry_run":
            self.segments_processed += report.segments
        if report.status in ("processed", "dry_run"):
            self.pages_processed += 1
        elif report.status == "skipped":
            self.pages_skipped += 1
        elif report.status == "skipped_too_large":
            self.pages_skipped_too_large += 1
        else:
            self.pages_failed += 1
        self.pages.append(report)

    def add_calls(self, result: SegmentResult) -> None:
        """Count a segment's LLM requests and tokens (every attempt that reached the provider)."""
        self.llm_calls += sum(attempt.called for attempt in result.attempts)
        for attempt in result.attempts:
            usage = attempt.response.usage if attempt.response is not None else attempt.usage
            if usage is not None:  # a failed reply's billed counts too, as llm_calls has them
                self.input_tokens += usage.input_tokens
                self.output_tokens += usage.output_tokens


class ExtractionProgress(Protocol):
    def pages_listed(self, count: int) -> None: ...
    def page_started(self, slug: str, segments: int) -> None: ...
    def segment_finished(self, slug: str, outcome: str) -> None: ...
    def page_finished(self, report: PageReport) -> None: ...


class NoProgress:
    """Progress that reports nothing; subclass it to hear only some of the events."""

    def pages_listed(self, count: int) -> None:
        pass

    def page_started(self, slug: str, segments: int) -> None:
        pass

    def segment_finished(self, slug: str, outcome: str) -> None:
        pass

    def page_finished(self, report: PageReport) -> None:
        pass


def iso_to_datetime(iso: str) -> datetime | None:
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None


def _instant(iso: str) -> bool:
    """Whether the segmenter reads ``iso`` (checked with its own parser: "2024-03-15Z" passed a check
    that rewrote the Z first, then failed the run, or a backfill's every planning attempt)."""
    try:
        instant_micros(iso.strip())
    except (ValueError, OverflowError):
        return False
    return True


def validate_since(since_iso: str | None, force: bool = False) -> None:
    """``since`` narrows what a run extracts incrementally. A forced run replaces each page's facts with
    what it extracts: narrowed, it deleted every fact from before ``since`` and moved the checkpoint past
    them, for good; so the two are refused together."""
    if since_iso is not None and not _instant(since_iso):
        raise ValueError(f"--since must be an ISO-8601 time such as 2024-03-15T00:00:00Z, got {since_iso!r}")
    if since_iso is not None and force:
        raise ValueError(
            "--since and --force cannot be combined: --force extracts whole pages again and replaces "
            "their facts, so the facts from before --since would be deleted; run one or the other"
        )


def page_types(config: ConfigReader) -> tuple[str, ...]:
    """The conversation page types to extract, narrowed by `extraction.page_types` when it is set."""
    return stored_page_types(config.get(EXTRACTION_PAGE_TYPES))


_SAID_REFUSED: set[str] = set()


def stored_page_types(value: str | None) -> tuple[str, ...]:
    """``narrow_page_types`` of a stored `extraction.page_types`; one the rules refuse (written past them:
    by hand, by an older release) is said in the log once, with what it is read as."""
    types = narrow_page_types(value)
    if value is not None and value.strip() and value not in _SAID_REFUSED:
        try:
            check_page_types(value)
        except ValueError as exc:
            _SAID_REFUSED.add(value)
            logger.warning(
                "config extraction.page_types is refused by its rules (%s); read as %s until it is set again",
                exc,
                ",".join(types),
            )
    return types


def resolve_max_facts(options: ExtractOptions, config: ConfigReader) -> int:
    """The cap on facts per segment: the option, else `extraction.max_facts`, else the option's default
    (FACTMILL_EXTRACTION_MAX_FACTS), each 1..25."""
    if options.max_facts is not None:
        value = options.max_facts
    else:  # a stored value no writer would take now (an older release's, a hand-written row): the default
        stored = stored_count(config.get(EXTRACTION_MAX_FACTS), MAX_FACTS_LIMIT)
        value = options.default_max_facts if stored is None else stored
    if not 1 <= value <= MAX_FACTS_LIMIT:
        raise ValueError(f"max_facts must be between 1 and {MAX_FACTS_LIMIT}, got {value}")
    return value


def resolve_max_segment_failures(config: ConfigReader) -> int:
    """How many permanent failures skip a segment: `extraction.max_segment_failures`, else 3."""
    stored = stored_count(config.get(EXTRACTION_MAX_SEGMENT_FAILURES), MAX_SEGMENT_FAILURES_CEILING)
    return DEFAULT_MAX_SEGMENT_FAILURES if stored is None else stored


def ensure_enabled(options: ExtractOptions, config: ConfigReader) -> None:
    """Raise ExtractionDisabledError when the kill switch is off (unless the run overrides it)."""
    if not options.override_disabled and not config.enabled(EXTRACTION_ENABLED):
        raise ExtractionDisabledError()
