"""What one sweep of the outbox did, and the one line it logs of it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("worker.jobs.outbox")  # the sweep's own logger, as before this module


@dataclass
class SweepReport:
    requeued_stale: list[int]
    resent_queued: list[int]
    resumed_paused: list[int]
    failed_spent: list[int] = field(default_factory=list)  # a budget ran out: failed, not re-sent

    @property
    def total(self) -> int:
        """Jobs re-sent to the broker."""
        return len(self.requeued_stale) + len(self.resent_queued) + len(self.resumed_paused)

    def log(self) -> None:
        """Counts and ten ids, when it did anything: every id made one 45 KB line (split by Docker)."""
        if not (self.total or self.failed_spent):
            return
        logger.info(
            "sweep re-sent %s job(s) (%s stale, %s lost, %s resumed; first ids %s) and failed %s",
            self.total,
            len(self.requeued_stale),
            len(self.resent_queued),
            len(self.resumed_paused),
            [*self.requeued_stale, *self.resent_queued, *self.resumed_paused][:10],
            len(self.failed_spent),
        )
