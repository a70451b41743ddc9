"""Kept for importers outside the extraction package (the API): pages are worker.extraction.pages."""

from __future__ import annotations

from worker.extraction.pages import (
    MAX_PAGE_BODY_BYTES,
    PageIn,
    UpsertResult,
    content_hash,
    store_page,
    upsert_page,
)

__all__ = ["MAX_PAGE_BODY_BYTES", "PageIn", "UpsertResult", "content_hash", "store_page", "upsert_page"]
