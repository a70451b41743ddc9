"""Kept for importers outside the extraction package (the CLI): batch mode is worker.extraction.batch."""

from __future__ import annotations

from worker.extraction.batch import BatchExtractionCounters, run_batch_extraction

__all__ = ["BatchExtractionCounters", "run_batch_extraction"]
