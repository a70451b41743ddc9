"""Committing a planned page's segment results in page order: incrementally, or as one swap."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from worker.core.checkpoint import CheckpointState, SkippedSegment, segment_hash
from worker.core.conversation import Segment
from worker.core.facts import ExtractedFact
from worker.extraction.options import ExtractionCounters, ExtractionProgress, PageReport
from worker.extraction.planner import PagePlan, PagePlanner
from worker.extraction.rows import SegmentPlace
from worker.extraction.segments import Attempt, SegmentResult
from worker.extraction.store import ExtractionStore, PageVersion, Terminal
from worker.runtime import tracing

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
        max_segment_failures: int,
    ) -> None:
        self.store = store
        self.planner = planner
        self.counters = counters
        self.progress = progress
        self.max_segment_failures = max_segment_failures

    def finish(self, report: PageReport) -> None:
        """A page is done (whatever its status): count it and tell the progress listener."""
        self.counters.add_page(report)
        self.progress.page_finished(report)

    def record_discarded(
        self, slug: str, index: int, segment: Segment, result: SegmentResult, note: str
    ) -> None:
        """A result the page could not use still cost money: record its attempts, facts unused."""
        self.counters.add_calls(result)
        self.store.record_attempts(
            self.planner.place(slug, index, segment), result.attempts, note=note, permanent=result.permanent
        )

    def poison(self, place: SegmentPlace, result: SegmentResult) -> tuple[str | None, int]:
        """(why the segment is skipped, or None to fail the page as before; its permanent failures
        counting this one). A permanent failure skips the segment once it is the K-th
        (`extraction.max_segment_failures`) since the segment last succeeded."""
        if result.ok or not result.permanent:
            return None, 0
        failures = self.store.permanent_failures(place) + 1
        if failures < self.max_segment_failures:
            return None, failures
        last = result.attempts[-1]
        return (
            f"skipped after {failures} permanent failures (extraction.max_segment_failures="
            f"{self.max_segment_failures}); last: {result.outcome}: {last.error or ''}",
            failures,
        )

    def count_skip(self, report: PageReport, slug: str) -> None:
        self.counters.segments_skipped += 1
        report.skipped += 1
        self.progress.segment_finished(slug, "skipped")

    def commit_page(self, plan: PagePlan, results: SegmentResults) -> PageReport:
        """Commit a planned page's segment results (in page order) through the per-segment transaction."""
        self.progress.page_started(plan.slug, len(plan.segments))
        try:
            if plan.replace:
                return self._commit_replacing(plan, results)
            return self._commit_incremental(plan, results)
        finally:
            results.close()

    def fail_page(
        self, report: PageReport, index: int, result: SegmentResult, tail: str = "", failures: int = 0
    ) -> PageReport:
        if failures:
            tail += f" (permanent failure {failures}; the segment is skipped at {self.max_segment_failures})"
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
            skip, failures = self.poison(place, result)
            if not result.ok and skip is None:
                self.store.record_attempts(place, result.attempts, permanent=result.permanent)
                self.progress.segment_finished(plan.slug, result.outcome)
                return self.fail_page(report, index, result, failures=failures)
            end = plan.ends[index]
            first_row = expected.next_row_num if expected else 0
            skipped = expected.skipped if expected else ()
            if skip is not None:
                skipped = (*skipped, skipped_entry(segment, end))
            new = CheckpointState(end, plan.hasher.digest(end), first_row + len(result.facts), skipped)
            terminal: Terminal = "keep"
            if index == last:
                terminal = "set"
            elif index == 0 and plan.checkpoint is not None:
                terminal = "clear"  # appended messages: the page is incomplete until its last new segment
            inserted = self.commit(
                place, result, expected=expected, new=new, terminal=terminal, page=plan.version, skip=skip
            )
            expected = new
            if skip is not None:
                self.count_skip(report, plan.slug)
                continue
            self.counters.segments_processed += 1
            self.counters.facts_extracted += len(result.facts)
            self.counters.facts_inserted += inserted
            report.segments += 1
            report.facts += inserted
            self.progress.segment_finished(plan.slug, "ok")
        return report

    def commit(
        self,
        place: SegmentPlace,
        result: SegmentResult,
        *,
        expected: CheckpointState | None,
        new: CheckpointState,
        terminal: Terminal,
        page: PageVersion | None,
        skip: str | None,
    ) -> int:
        """One segment's transaction (attempts, facts, checkpoint compare-and-set); the facts inserted."""
        with tracing.span("segment commit", segment_attributes(place, skipped=skip is not None)):
            inserted = self.store.commit_segment(
                place,
                result.attempts,
                result.facts,
                fingerprint=self.planner.fingerprint,
                expected=expected,
                new=new,
                terminal=terminal,
                page=page,
                skip=skip,
            )
            tracing.annotate("factmill.facts.inserted", inserted)
        return inserted

    def _commit_replacing(self, plan: PagePlan, results: SegmentResults) -> PageReport:
        """Re-extract the page and swap its facts in one transaction, only if every segment succeeded."""
        report = PageReport(plan.slug, "processed")
        segment_facts: list[tuple[SegmentPlace, Sequence[ExtractedFact]]] = []
        skips: list[tuple[SegmentPlace, Sequence[Attempt], str]] = []
        skipped: list[SkippedSegment] = []
        for index, segment, result in results:
            place = self.planner.place(plan.slug, index, segment)
            skip, failures = self.poison(place, result)
            self.store.record_attempts(place, result.attempts, permanent=result.permanent)
            if skip is not None:  # its skipped row goes in with the swap that moves past it
                skips.append((place, result.attempts, skip))
                skipped.append(skipped_entry(segment, plan.ends[index]))
                self.count_skip(report, plan.slug)
                continue
            self.progress.segment_finished(plan.slug, result.outcome)
            if not result.ok:
                tail = "; the page's earlier facts were kept"
                return self.fail_page(report, index, result, tail, failures=failures)
            segment_facts.append((place, result.facts))
            report.segments += 1
        missing = len(plan.segments) - report.segments - report.skipped
        if missing:
            # The results ran out (a batch that expired): swapping now would drop the page's later facts.
            report.status = "incomplete"
            report.reason = f"{missing} segment(s) had no result; the earlier facts were kept"
            return report
        end = plan.ends[-1]
        total = sum(len(facts) for _, facts in segment_facts)
        last = self.planner.place(plan.slug, len(plan.segments) - 1, plan.segments[-1])
        with tracing.span("page replace", {**segment_attributes(last), "factmill.segments": report.segments}):
            inserted = self.store.replace_page(
                self.planner.fingerprint,
                last,
                segment_facts,
                CheckpointState(end, plan.hasher.digest(end), total, tuple(skipped)),
                page=plan.version,
                skips=skips,
            )
        self.counters.segments_processed += report.segments
        self.counters.facts_extracted += total
        self.counters.facts_inserted += inserted
        report.facts = inserted
        return report


def skipped_entry(segment: Segment, end: int) -> SkippedSegment:
    """The checkpoint's record of a skipped segment: the messages [end - len, end) of the page."""
    return SkippedSegment(
        end - len(segment.messages), end, segment_hash(segment), segment.start_iso, segment.end_iso
    )


def segment_attributes(place: SegmentPlace, *, skipped: bool = False) -> dict[str, str | int | bool]:
    """What a commit's span says about the segment (ids and positions only, never page text)."""
    attributes: dict[str, str | int | bool] = {
        "factmill.source": place.source_id,
        "factmill.page.slug": place.slug,
        "factmill.segment.index": place.index,
        "factmill.segment.skipped": skipped,
    }
    if place.job_id is not None:
        attributes["factmill.job.id"] = place.job_id
    return attributes
