"""Test helpers for the tracing tests: span trees (from the SDK's in-memory exporter or decoded OTLP)
and the checks that one page gave one connected trace."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import Job, LLMCall

LLM_PATHS = ("/chat/completions", "/messages")  # the OpenAI and Anthropic wire formats of the simulator


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.attributes.get("url.full") or self.attributes.get("http.url") or "")

    def is_llm_call(self, base_url: str) -> bool:
        return self.url.startswith(base_url) and self.url.endswith(LLM_PATHS)


def from_sdk(spans: Iterable[Any]) -> list[SpanRecord]:
    """ReadableSpans of the in-memory exporter as records."""
    records = []
    for span in spans:
        parent = span.parent.span_id if span.parent is not None else None
        records.append(
            SpanRecord(
                trace_id=f"{span.context.trace_id:032x}",
                span_id=f"{span.context.span_id:016x}",
                parent_id=f"{parent:016x}" if parent is not None else None,
                name=span.name,
                service=str(span.resource.attributes.get("service.name", "")),
                attributes=dict(span.attributes or {}),
            )
        )
    return records


def one_trace(spans: list[SpanRecord], root: SpanRecord) -> list[SpanRecord]:
    """The spans of ``root``'s trace, after checking each of them reaches ``root`` through its parents
    (a span whose parent was never exported, or that starts a tree of its own, breaks the trace)."""
    assert root.parent_id is None, f"the root {root.name!r} has a parent {root.parent_id}"
    members = [span for span in spans if span.trace_id == root.trace_id]
    by_id = {span.span_id: span for span in members}
    for span in members:
        seen = span
        hops = 0
        while seen.parent_id is not None:
            parent = by_id.get(seen.parent_id)
            assert parent is not None, f"{span.name!r} ({span.service}) has a parent that is not in the trace"
            seen, hops = parent, hops + 1
            assert hops < 1000, "a cycle of parents"
        where = f"{span.name!r} ({span.service}) reaches {seen.name!r}"
        assert seen.span_id == root.span_id, f"{where}, not the root"
    return members


def ancestors(span: SpanRecord, members: list[SpanRecord]) -> list[str]:
    by_id = {member.span_id: member for member in members}
    names = []
    while span.parent_id is not None:
        span = by_id[span.parent_id]
        names.append(span.name)
    return names


def llm_calls(factory: sessionmaker[Session], job_id: int, purpose: str = "extraction") -> int:
    with factory() as session:
        return int(
            session.scalar(select(func.count()).where(LLMCall.job_id == job_id, LLMCall.purpose == purpose))
            or 0
        )


def segments_processed(factory: sessionmaker[Session], job_id: int) -> int:
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return int(job.counters.get("segments_processed", 0))


def names(spans: Iterable[SpanRecord]) -> Counter[str]:
    return Counter(span.name for span in spans)


def committed_segments(spans: Iterable[SpanRecord]) -> list[int]:
    """The segment indices the "segment commit" spans cover: one span per transaction, which holds
    ``factmill.segments`` consecutive segments from ``factmill.segment.index``."""
    covered: list[int] = []
    for span in spans:
        if span.name == "segment commit":
            first = int(span.attributes["factmill.segment.index"])
            covered += range(first, first + int(span.attributes.get("factmill.segments", 1)))
    return sorted(covered)
