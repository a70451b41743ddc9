"""A job's two budgets: runs that ended on their own (``attempts``) and runs its worker never finished
(``worker_losses``). The one place that says when either is spent and what the job's reason reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.settings import Settings


@dataclass(frozen=True)
class JobBudgets:
    """``max_attempts`` bounds the job's own failures; ``max_worker_losses`` (larger) bounds how often
    infrastructure may cut a run short (SIGKILL, OOM, a lost lease, the database going away) before the
    job is failed instead of crash-looping. A pause (kill switch, LLM budget) costs neither."""

    max_attempts: int
    max_worker_losses: int

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_worker_losses < 1:
            raise ValueError(f"both job budgets must be at least 1, got {self}")

    @classmethod
    def from_settings(cls, settings: Settings) -> JobBudgets:
        return cls(settings.job_max_attempts, settings.job_max_worker_losses)

    def attempts_spent(self, attempts: int) -> bool:
        """After a run that failed on its own and left the job at ``attempts``: no retry remains."""
        return attempts >= self.max_attempts

    def losses_spent(self, worker_losses: int) -> bool:
        return worker_losses >= self.max_worker_losses

    def spent_reason(self, attempts: int, worker_losses: int) -> str | None:
        """Why a job with these counters must not run again (None: it may). Checked wherever a job
        would be started or sent, so no path runs a job past either cap."""
        if self.losses_spent(worker_losses):
            return worker_lost_reason(worker_losses)
        if self.attempts_spent(attempts):
            return f"attempts spent ({attempts} of {self.max_attempts}); retry it by hand to start over"
        return None


def worker_lost_reason(worker_losses: int) -> str:
    return f"worker lost {worker_losses} times"


__all__ = ["JobBudgets", "worker_lost_reason"]
