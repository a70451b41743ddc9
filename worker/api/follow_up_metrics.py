"""How far the follow-ups after a commit (embedding, consolidation) lag behind the facts, for the alert
that sees them stop: a fact neither step reached was missed by vector search, or answered reads
beside its own duplicate, and nothing said so (the sweeps' catch-ups give up on facts a day old)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import Fact
from models.fact import UNCONSOLIDATED_SQL, UNEMBEDDED_SQL
from worker.api.scrape_reads import ScrapeTimeCollector
from worker.llm.gateway import embeds_new_facts
from worker.settings import Settings

EMBEDDING = "embedding"
CONSOLIDATION = "consolidation"
# Each step's predicate, written as its partial index's (ix_facts_unembedded, ix_facts_unconsolidated)
# so the planner reads the index: the oldest is its first entry, the count stops at the cap.
_PENDING = {EMBEDDING: UNEMBEDDED_SQL, CONSOLIDATION: UNCONSOLIDATED_SQL}
# A backfill of a million facts awaits both steps by the million; counting them all took seconds a scrape.
AWAITING_COUNT_CAP = 100_000


def follow_up_steps(settings: Settings) -> tuple[str, ...]:
    """The follow-ups this deployment runs after a commit (by the API's settings, which the workers
    share): a step it does not run would leave every fact awaiting it, and its alert firing for good."""
    steps = (EMBEDDING,) if embeds_new_facts(settings) else ()
    return (*steps, CONSOLIDATION) if settings.consolidate_after_extraction else steps


def _awaiting(session: Session, step: str) -> tuple[float, int]:
    pending = text(_PENDING[step])
    oldest = session.scalar(
        select(func.extract("epoch", func.now() - func.min(Fact.created_at))).where(pending)
    )
    listed = select(Fact.created_at).where(pending).limit(AWAITING_COUNT_CAP).subquery()
    count = session.scalar(select(func.count()).select_from(listed))
    return max(0.0, float(oldest or 0.0)), int(count or 0)


class FollowUpCollector(ScrapeTimeCollector[dict[str, tuple[float, int]]]):
    """``factmill_facts_awaiting{step}``: facts (audit rows aside) the step has not reached yet, counted
    up to AWAITING_COUNT_CAP; ``factmill_facts_awaiting_oldest_seconds{step}``: the age of the oldest,
    0 with none. Only the steps the deployment runs (``follow_up_steps``)."""

    reads = "the facts awaiting their follow-ups"

    def __init__(self, factory: sessionmaker[Session], steps: Sequence[str]) -> None:
        super().__init__(factory)
        self.steps = tuple(steps)

    def read(self, session: Session) -> dict[str, tuple[float, int]]:
        return {step: _awaiting(session, step) for step in self.steps}

    def metrics(self, rows: dict[str, tuple[float, int]]) -> list[Metric]:
        if not rows:
            return []
        count = GaugeMetricFamily(
            "factmill_facts_awaiting",
            f"Facts a follow-up after their commit has not reached yet, by step (counted up to "
            f"{AWAITING_COUNT_CAP:,})",
            labels=["step"],
        )
        oldest = GaugeMetricFamily(
            "factmill_facts_awaiting_oldest_seconds",
            "Age (since it was stored) of the oldest fact a follow-up has not reached yet, by step; 0 with "
            "none. The sweeps catch "
            "up what a follow-up left after minutes and give up after a day: `factmill embed`, "
            "`factmill facts consolidate`",
            labels=["step"],
        )
        for step, (age, n) in sorted(rows.items()):
            count.add_metric([step], n)
            oldest.add_metric([step], age)
        return [count, oldest]


__all__ = ["AWAITING_COUNT_CAP", "FollowUpCollector", "follow_up_steps"]
