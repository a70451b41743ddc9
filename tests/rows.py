"""Row builders for tests that write tables directly."""

from __future__ import annotations

from typing import Any

from models import ExtractionAudit
from worker.extraction.rows import FACT_COLUMNS


def fact_row(row_num: int, text: str = "Alice works at Acme") -> dict[str, object]:
    """A ``facts`` row of page ``p`` in source ``default``, every column of FACT_COLUMNS named."""
    return {name: None for name in FACT_COLUMNS} | {
        "source_id": "default",
        "fact": text,
        "kind": "fact",
        "confidence": 0.9,
        "notability": "low",
        "context": "",
        "source": "test",
        "source_session": "test:p",
        "source_markdown_slug": "p",
        "row_num": row_num,
        "is_audit": False,
    }


def audit_row(page_slug: str = "p", **columns: Any) -> ExtractionAudit:
    """An ``extraction_audit`` row of ``page_slug`` in source ``default``: segment 0, outcome ok, unless
    ``columns`` say otherwise (a job_id, an llm_call_id)."""
    defaults: dict[str, Any] = {
        "source_id": "default",
        "segment_index": 0,
        "segment_start": "s",
        "segment_end": "e",
        "outcome": "ok",
    }
    return ExtractionAudit(page_slug=page_slug, **(defaults | columns))
