"""Committing a planned page's segment results in page order: incrementally, or as one swap."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from worker.core.checkpoint import CheckpointState
from worker.core.conversation import Segment
from worker.core.facts import ExtractedFact
from worker.extraction.options import ExtractionCounters, ExtractionProgress, PageReport
from worker.extraction.planner import PagePlan, PagePlanner
from worker.extraction.segments import SegmentResult
from worker.extraction.store import ExtractionStore, SegmentPlace, Terminal

# (segment index, segment, its result), in page order; the consumer may stop early.
SegmentResults = Generator[tuple[int, Segment, SegmentResult], None, None]


class SegmentCommitter:
    """Writes segment results through the store and keeps the run's counters and progress."""

    def __init__(
        self,
        store: ExtractionStore,
        planner: PagePlanner,
        counters: ExtractionCounters,
        progress: ExtractionProgress,
    ) -> None:
        self.store = store
        self.planner = planner
        self.counters = counters
        self.progress = progress

    def finish(self, report: PageReport) -> None:
        """A page is done (whatever its status): count it and tell the progress listener."""
        self.counters.add_page(report)
        self.progress.page_finished(report)

    def record_discarded(
        self, slug: str, index: int, segment: Segment, result: SegmentResult, note: str
    ) -> None:
        """A result the page could not use still cost money: record its attempts, facts unused."""
        self.counters.add_calls(result)
        self.store.record_attempts(self.planner.place(slug, index, segment), result.attempts, note=note)

    def commit_page(self, plan: PagePlan, results: SegmentResults) -> PageReport:
        """Commit a planned page's segment results (in page order) through the per-segment transaction."""
        self.progress.page_started(plan.slug, len(plan.segments))
        try:
            if plan.replace:
                return self._commit_replacing(plan, results)
            return self._commit_incremental(plan, results)
        finally:
            results.close()

    def _failed(self, report: PageReport, index: int, result: SegmentResult, tail: str = "") -> PageReport:
        self.counters.segments_failed += 1
        report.status, report.outcome = "failed", result.outcome
        report.reason = f"segment {index + 1}: {result.outcome}: {result.attempts[-1].error or ''}{tail}"
        return report

    def _commit_incremental(self, plan: PagePlan, results: SegmentResults) -> PageReport:
        """One transaction per result as it comes; if they end early the rest wait for a later run."""
        report = PageReport(plan.slug, "processed")
        expected = plan.checkpoint
        last = len(plan.segments) - 1
        for index, segment, result in results:
            place = self.planner.place(plan.slug, index, segment)
            if not result.ok:
                self.store.record_attempts(place, result.attempts)
                self.progress.segment_finished(plan.slug, result.outcome)
                return self._failed(report, index, result)
            end = plan.ends[index]
            first_row = expected.next_row_num if expected else 0
            new = CheckpointState(end, plan.hasher.digest(end), first_row + len(result.facts))
            terminal: Terminal = "keep"
            if index == last:
                terminal = "set"
            elif index == 0 and plan.checkpoint is not None:
                terminal = "clear"  # appended messages: the page is incomplete until its last new segment
            inserted = self.store.commit_segment(
                place,
                result.attempts,
                result.facts,
                fingerprint=self.planner.fingerprint,
                expected=expected,
                new=new,
                terminal=terminal,
                page=plan.version,
            )
            expected = new
            self.counters.segments_processed += 1
            self.counters.facts_extracted += len(result.facts)
            self.counters.facts_inserted += inserted
            report.segments += 1
            report.facts += inserted
            self.progress.segment_finished(plan.slug, "ok")
        return report

    def _commit_replacing(self, plan: PagePlan, results: SegmentResults) -> PageReport:
        """Re-extract the page and swap its facts in one transaction, only if every segment succeeded."""
        report = PageReport(plan.slug, "processed")
        segment_facts: list[tuple[SegmentPlace, Sequence[ExtractedFact]]] = []
        for index, segment, result in results:
            place = self.planner.place(plan.slug, index, segment)
            self.store.record_attempts(place, result.attempts)
            self.progress.segment_finished(plan.slug, result.outcome)
            if not result.ok:
                return self._failed(report, index, result, "; the page's earlier facts were kept")
            segment_facts.append((place, result.facts))
            report.segments += 1
        missing = len(plan.segments) - report.segments
        if missing:
            # The results ran out (a batch that expired): swapping now would drop the page's later facts.
            report.status = "incomplete"
            report.reason = f"{missing} segment(s) had no result; the earlier facts were kept"
            return report
        end = plan.ends[-1]
        total = sum(len(facts) for _, facts in segment_facts)
        last = self.planner.place(plan.slug, len(plan.segments) - 1, plan.segments[-1])
        inserted = self.store.replace_page(
            self.planner.fingerprint,
            last,
            segment_facts,
            CheckpointState(end, plan.hasher.digest(end), total),
            page=plan.version,
        )
        self.counters.segments_processed += len(plan.segments)
        self.counters.facts_extracted += total
        self.counters.facts_inserted += inserted
        report.facts = inserted
        return report
