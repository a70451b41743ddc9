"""Kept for importers outside the extraction package (CLI, demo): ingest is worker.extraction.ingest."""

from __future__ import annotations

from worker.extraction.ingest import (
    PAGE_SUFFIXES,
    IngestReport,
    PageFileError,
    ingest_paths,
    iter_page_files,
    load_page_file,
)

__all__ = [
    "PAGE_SUFFIXES",
    "IngestReport",
    "PageFileError",
    "ingest_paths",
    "iter_page_files",
    "load_page_file",
]
