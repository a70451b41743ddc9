"""The rows a segment's commit writes, built from its attempts: audit rows, llm_calls records, facts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.accounting import LLMCallRecord
from worker.core.checkpoint import segment_hash
from worker.core.conversation import Segment
from worker.core.facts import ExtractedFact
from worker.core.jsonvalues import made_storable
from worker.extraction.options import PER_SEGMENT_SOURCE_PREFIX, iso_to_datetime
from worker.extraction.prompts import LLM_PURPOSE
from worker.extraction.segments import Attempt

# How much of a failed reply an audit row keeps as the model's words.
REPLY_CHARS = 2000
SKIPPED = "skipped"
# The columns the rows below fill, in one list each, for the bulk inserts (models.bulk).
PLACE_COLUMNS = (
    "job_id",
    "source_id",
    "page_slug",
    "segment_index",
    "segment_start",
    "segment_end",
    "segment_hash",
)
AUDIT_COLUMNS = (
    *PLACE_COLUMNS,
    "attempt",
    "outcome",
    "facts_count",
    "error",
    "llm_call_id",
    "permanent",
    "reply",
)
FACT_COLUMNS = (
    "source_id",
    "fact",
    "kind",
    "entity_slug",
    "confidence",
    "notability",
    "context",
    "valid_from",
    "source",
    "source_session",
    "source_markdown_slug",
    "row_num",
    "is_audit",
    "claim_metric",
    "claim_value",
    "claim_unit",
    "claim_period",
)


@dataclass(frozen=True)
class SegmentPlace:
    """Where a segment's attempts belong: the job, the page and the segment."""

    job_id: int | None
    source_id: str
    slug: str
    index: int
    segment: Segment


def audit_rows(
    place: SegmentPlace,
    attempts: Sequence[Attempt],
    errors: Sequence[str | None],
    call_ids: Sequence[int | None],
    *,
    permanent: bool,
) -> list[dict[str, Any]]:
    """One audit row per attempt; ``permanent`` marks the last one as a permanent failure."""
    last = len(attempts)
    where = _place_columns(place)
    return [
        {
            **where,
            "attempt": number,
            "outcome": a.outcome,
            "facts_count": len(a.facts),
            "error": error,
            "llm_call_id": call_id,
            "permanent": permanent and number == last,
            "reply": _reply(a),
        }
        for number, (a, error, call_id) in enumerate(zip(attempts, errors, call_ids, strict=True), start=1)
    ]


def _place_columns(place: SegmentPlace) -> dict[str, Any]:
    """The columns that say which segment of which page and job an audit row is about."""
    return {
        "job_id": place.job_id,
        "source_id": place.source_id,
        "page_slug": place.slug,
        "segment_index": place.index,
        "segment_start": place.segment.start_iso,
        "segment_end": place.segment.end_iso,
        "segment_hash": segment_hash(place.segment),
    }


def _reply(attempt: Attempt) -> str | None:
    """The model's words on a failed attempt (a refusal's text, a malformed or cut-off reply), capped."""
    if attempt.outcome == "ok" or attempt.response is None:
        return None
    words = attempt.response.refusal or attempt.response.text
    return words[:REPLY_CHARS] if words else None


def skip_row(place: SegmentPlace, attempts: Sequence[Attempt], reason: str) -> dict[str, Any]:
    """The audit row that marks a segment skipped: why, and the model's last words about it."""
    last = attempts[-1] if attempts else None
    return {
        **_place_columns(place),
        "attempt": len(attempts) + 1,
        "outcome": SKIPPED,
        "facts_count": 0,
        "error": reason,
        "llm_call_id": None,
        "permanent": False,
        "reply": _reply(last) if last is not None else None,
    }


# What the rows of a segment held for a whole-page swap say: recorded before the swap, which may not come
# (as "ok, N facts" alone, they looked committed when a later segment failed and the page kept its facts).
HELD_NOTE = "held for the page's swap: its facts went in only if every segment of the page succeeded"


def held_note(attempts: Sequence[Attempt]) -> str | None:
    """HELD_NOTE for a segment the model answered (a failed one's rows say why it failed)."""
    return HELD_NOTE if attempts and attempts[-1].outcome == "ok" else None


def errors_of(attempts: Sequence[Attempt], note: str | None) -> list[str | None]:
    """Each attempt's error as its audit row and llm_calls row store it (a provider's words may hold a
    NUL, which no text column takes)."""
    return [made_storable("; ".join(part for part in (a.error, note) if part)) or None for a in attempts]


def call_records(
    place: SegmentPlace, attempts: Sequence[Attempt], note: str | None = None
) -> list[LLMCallRecord]:
    """The llm_calls rows of a segment's attempts. HELD_NOTE stays on the audit rows: on a call that
    succeeded it read as an error, and an erasure replaced it with "the provider's message went"."""
    note = None if note == HELD_NOTE else note
    return [
        LLMCallRecord(
            purpose=LLM_PURPOSE,
            provider=a.provider,
            model=a.model,
            usage=a.response.usage if a.response else a.usage,
            latency_ms=a.latency_ms,
            outcome=a.outcome,
            job_id=place.job_id,
            error=error,
            batch=a.batch,
        )
        for a, error in zip(attempts, errors_of(attempts, note), strict=True)
        if a.called  # refused before any request (budget): an audit row but no llm_calls row
    ]


def fact_rows(facts: Sequence[ExtractedFact], place: SegmentPlace, first_row: int) -> list[dict[str, Any]]:
    segment, slug = place.segment, place.slug
    valid_from = iso_to_datetime(segment.start_iso)
    context = f"conversation segment {segment.start_iso} to {segment.end_iso}"
    return [
        {
            "source_id": place.source_id,
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
