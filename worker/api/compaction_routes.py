"""Old home of the transcripts routes (now worker.api.routes.transcripts); kept for its importers."""

from __future__ import annotations

from worker.api.metrics import CompactionCollector

__all__ = ["CompactionCollector"]
