"""Row builders for tests that write tables directly."""

from __future__ import annotations

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
