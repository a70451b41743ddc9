"""What one compaction run did: the outcome the API, the CLI, the MCP server and the job's row report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from worker.compaction.waits import SUPERSEDED

CompactionStatus = Literal["accepted", "rejected", "failed", "not_needed", "nothing_to_compact"]


@dataclass
class CompactionOutcome:
    """What one compaction run did; ``compaction_id`` is what POST /v1/feedback labels."""

    status: CompactionStatus
    transcript_id: str
    detail: str = ""
    compaction_id: int | None = None
    cut_seq: int | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    coverage: float | None = None
    density: float | None = None
    threshold_tau: float | None = None
    threshold_version: int | None = None
    attempts: int = 0
    missed_terms: list[str] = field(default_factory=list)
    head_capped: bool = False  # the head was cut to fit the summarizer's input: more remains to compact

    @property
    def tokens_saved(self) -> int:
        if self.status != "accepted" or self.tokens_before is None or self.tokens_after is None:
            return 0
        return self.tokens_before - self.tokens_after

    @property
    def superseded(self) -> bool:
        """Not applied because another compaction, accepted while this one ran, replaced the timeline it
        summarized: nothing failed (a job so ended succeeds; `compact --now` exits 0)."""
        return self.status == "failed" and self.detail.startswith(SUPERSEDED)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens_saved"] = self.tokens_saved
        data["superseded"] = self.superseded  # `compact --now --json`: "failed", yet nothing to do
        return data

    def job_counters(self) -> dict[str, Any]:
        """What the job's row keeps: the figures, not the transcript's id (a client's label, which can
        name a person) nor its words (the missed terms, a failure's detail); the compaction row keeps
        those, and goes with the transcript when it is erased."""
        data = {k: v for k, v in self.as_dict().items() if k not in _NOT_IN_JOB_ROWS}
        data["missed_terms"] = len(self.missed_terms)
        return data


_NOT_IN_JOB_ROWS = frozenset({"transcript_id", "detail", "missed_terms", "superseded"})


__all__ = ["CompactionOutcome", "CompactionStatus"]
