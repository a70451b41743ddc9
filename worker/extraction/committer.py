"""Committing a planned page's segment results in page order: incrementally, or as one swap."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from worker.core.checkpoint import CheckpointState, SkippedSegment, skipped_record
from worker.core.conversation import Segment
from worker.core.errors import error_summary
from worker.core.facts import ExtractedFact
from worker.extraction.options import (
    CheckpointConflictError,
    ExtractionCounters,
    ExtractionProgress,
    PageChangedError,
    PageErasedError,
    PageReport,
)
from worker.extraction.planner import PagePlan, PagePlanner
from worker.extraction.rows import SegmentPlace
from worker.extraction.segments import Attempt, SegmentResult
from worker.extraction.store import ExtractionStore, PageVersion, SegmentCommit, Terminal
from worker.runtime import tracing

logger = logging.getLogger(__name__)

# (segment index, segment, its result), in page order; the consumer may stop early.
SegmentResult3 = tuple[int, Segment, SegmentResult]
SegmentResults = Generator[SegmentResult3, None, None]
# The same in runs of consecutive results that are ready together (committed in one transaction).
ResultBatches = Generator[list[SegmentResult3], None, None]
# (source id, page slug, facts inserted): called once per transaction that committed facts of a page.
FactsCommitted = Callable[[str, str, int], None]
# A run of consecutive segments this long at most goes in one transaction.
MAX_SEGMENTS_PER_COMMIT = 256
DISCARDED_UNUSED = "discarded: an earlier segment did not complete"


def one_at_a_time(results: SegmentResults) -> ResultBatches:
    """Results that come one by one (a provider batch's) as runs of one."""
    try:
        for item in results:
            yield [item]
    finally:
        results.close()


# The failures whose error text is the infrastructure's, not the model's.
INFRASTRUCTURE_OUTCOMES = ("provider_error", "budget_exhausted")


def counts_when_discarded(result: SegmentResult) -> bool:
    """Whether a permanent failure the page got but could not use (behind an earlier failure) counts
    towards skipping its segment: a refusal or an unusable reply does (it is the segment's; a page with
    several poison segments skips those whose attempts ended within max_segment_failures runs: one whose
    repair turn the page's stop refused has not ended, and counts on a later run), a request the provider
    rejected does not (a setting it did not blame itself for rejects every request alike: a batch of them
    counted every segment of every page at once, and skipped pages whole)."""
    return result.permanent and not (result.attempts and result.attempts[-1].rejected)


class SegmentCommitter:
    """Writes segment results through the store and keeps the run's counters and progress."""

    def __init__(
        self,
        store: ExtractionStore,
        planner: PagePlanner,
        counters: ExtractionCounters,
        progress: ExtractionProgress,
        max_segment_failures: int,
        on_facts_committed: FactsCommitted | None = None,
    ) -> None:
        self.store = store
        self.planner = planner
        self.counters = counters
        self.progress = progress
        self.max_segment_failures = max_segment_failures
        self.on_facts_committed = on_facts_committed
        # The job's lease alone, checked before each commit on the page's thread: the guard runs on the
        # pipe's threads before calls, so a worker whose lease lapsed went on committing every result it
        # held (up to twice the pipe), and the worker that took the job over met a checkpoint conflict,
        # spending an attempt and throwing its own paid window away. Not the stopping worker's check:
        # what is paid for is written while the lease holds.
        self.lease: Callable[[], None] | None = None
        # A commit found the page changed (erased, perhaps): what it discards gets no audit rows.
        self.page_gone: PageChangedError | None = None
        # The page being committed, as planned: attempts recorded outside a commit hold its row and
        # write no audit rows once an erasure took it (they named it after the erasure had run).
        self.version: PageVersion | None = None

    def facts_committed(self, slug: str, inserted: int, *, replaced: bool = False) -> None:
        """Facts of page ``slug`` were committed (``inserted`` of them, in one transaction): the one
        place that says so, whichever path committed them (so follow-up work hooks here). ``replaced``:
        the page's facts were swapped whole, so it says so with none inserted too (facts of other pages
        the old ones had closed wait for the consolidation the follow-up asks for)."""
        if (inserted or replaced) and self.on_facts_committed is not None:
            self.on_facts_committed(self.planner.options.source_id, slug, inserted)

    def finish(self, report: PageReport) -> None:
        """A page is done (whatever its status): count it and tell the progress listener."""
        self.counters.add_page(report)
        self.progress.page_finished(report)

    def record_discarded(
        self, slug: str, index: int, segment: Segment, result: SegmentResult, note: str
    ) -> None:
        """A result the page could not use still cost money: record its attempts, facts unused."""
        self.counters.add_calls(result)
        self._keep_spend(slug, index, segment, result, note)

    def _keep_unhanded(self, slug: str, batch: Sequence[SegmentResult3], handed: set[int]) -> None:
        for index, segment, result in batch:
            if index not in handed:  # counted as calls already, when the page took them
                self._keep_spend(slug, index, segment, result, DISCARDED_UNUSED)

    def keep_after_failure(self, slug: str, batch: Sequence[SegmentResult3], handed: set[int]) -> None:
        """After a database error in a batch, the spend of its results not yet recorded (unless the store
        can read them again: a backfill's stay at the provider). Never raises: the first error is the
        one to raise (the database is probably away)."""
        if self.store.results_read_again:
            return
        try:
            self._keep_unhanded(slug, batch, handed)
        except Exception as keeping:
            logger.warning("could not keep a failed batch's spend: %s", error_summary(keeping))

    def _keep_spend(self, slug: str, index: int, segment: Segment, result: SegmentResult, note: str) -> None:
        """A paid result's rows: llm_calls and audit rows, or the calls alone when the page changed (its
        audit rows describe it, and an erasure has just taken them out; an erasure's, without a provider's
        message either)."""
        place = self.planner.place(slug, index, segment)
        if self.page_gone is not None:
            erased = isinstance(self.page_gone, PageErasedError)
            self.store.record_spend([(place, result.attempts)], erased=erased)
        else:
            self.store.record_attempts(
                place, result.attempts, note=note, permanent=counts_when_discarded(result), page=self.version
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

    def commit_page(self, plan: PagePlan, results: ResultBatches) -> PageReport:
        """Commit a planned page's segment results (in page order, in runs of consecutive ones): each
        run in one transaction that moves the checkpoint over all of it."""
        self.progress.page_started(plan.slug, len(plan.segments))
        self.page_gone = None  # set when a commit finds the page changed: what it discards gets no audit
        self.version = plan.version
        try:
            if plan.replace:
                return self._commit_replacing(plan, results)
            return self._commit_incremental(plan, results)
        except (KeyboardInterrupt, SystemExit) as stopped:
            # Into the results' generator, not a GeneratorExit: its wait for the calls in flight says why.
            with contextlib.suppress(BaseException):
                results.throw(stopped)
            raise
        finally:
            results.close()

    def fail_page(
        self, report: PageReport, index: int, result: SegmentResult, tail: str = "", failures: int = 0
    ) -> PageReport:
        if failures:
            tail += f" (permanent failure {failures}; the segment is skipped at {self.max_segment_failures})"
        self.counters.segments_failed += 1
        report.status, report.outcome = "failed", result.outcome
        report.provider_away = result.outcome == "provider_error" and result.attempts[-1].provider_away
        # The provider's or the budget's words only: a refusal's (or a malformed reply's) are the model's,
        # which can paraphrase the page, and the reason goes into jobs.last_error, which no erasure of
        # the page reads (the audit rows keep them, and go with it).
        said = result.attempts[-1].error if result.outcome in INFRASTRUCTURE_OUTCOMES else None
        report.reason = f"segment {index + 1}: {result.outcome}{f': {said}' if said else ''}{tail}"
        return report

    def _commit_incremental(self, plan: PagePlan, batches: ResultBatches) -> PageReport:
        """One transaction per run of results as they come; if they end early the rest wait for a
        later run. A failed segment ends the page: the run before it commits, the rest is discarded."""
        report = PageReport(plan.slug, "processed")
        expected = plan.checkpoint
        for batch in batches:
            handed: set[int] = set()  # indexes given to a commit: committed, or kept by the store if refused
            try:
                outcome = self._commit_batch(plan, batch, expected, report, handed)
            except CheckpointConflictError as exc:
                # Another run moved the page on, or it changed: the rest of the batch was paid for too.
                # A page changed (erased, perhaps) gets no audit rows: they describe it.
                self.page_gone = exc if isinstance(exc, PageChangedError) else None
                self._keep_unhanded(plan.slug, batch, handed)
                raise
            except BaseException:
                # The commit failed otherwise (a deadlock, a timeout, the connection dropped; or a
                # SIGTERM, raised as SystemExit): the store kept the spend of what it was given; the rest
                # of the batch was paid for as well.
                self.keep_after_failure(plan.slug, batch, handed)
                raise
            if isinstance(outcome, PageReport):
                return outcome
            expected = outcome
        return report

    def _commit_batch(
        self,
        plan: PagePlan,
        batch: Sequence[SegmentResult3],
        expected: CheckpointState | None,
        report: PageReport,
        handed: set[int],
    ) -> CheckpointState | PageReport | None:
        """One run of ready results, committed in runs of MAX_SEGMENTS_PER_COMMIT: the checkpoint they
        moved to, or the page's report when a failed segment ended it (the rest discarded)."""
        pending: list[tuple[SegmentCommit, int]] = []  # with each segment's index
        for position, (index, segment, result) in enumerate(batch):
            place = self.planner.place(plan.slug, index, segment)
            skip, failures = self.poison(place, result)
            if not result.ok and skip is None:
                expected = self._commit_run(plan, pending, expected, report, handed)
                self.store.record_attempts(
                    place,
                    result.attempts,
                    permanent=result.permanent,
                    page=self.version,
                    incomplete=index == 0 and plan.checkpoint is not None,  # (appended, none committed)
                )
                handed.add(index)
                self.progress.segment_finished(plan.slug, result.outcome)
                self.discard(plan.slug, batch[position + 1 :], handed)
                return self.fail_page(report, index, result, failures=failures)
            first_row = expected.next_row_num if expected else 0
            first_row += sum(len(c.facts) for c, _ in pending)
            # Handed when its commit is asked (not now): a later segment's database read that failed
            # before the run's commit left these paid results unrecorded.
            pending.append((SegmentCommit(place, result.attempts, result.facts, first_row, skip), index))
            if len(pending) >= MAX_SEGMENTS_PER_COMMIT:
                expected = self._commit_run(plan, pending, expected, report, handed)
                pending = []
        return self._commit_run(plan, pending, expected, report, handed)

    def discard(self, slug: str, rest: Sequence[SegmentResult3], handed: set[int] | None = None) -> None:
        """Results the page got but cannot use (after a failed segment): recorded, facts unused (each
        added to ``handed`` once recorded, so a failure part way does not record it twice)."""
        for index, segment, result in rest:
            self.store.record_attempts(
                self.planner.place(slug, index, segment),
                result.attempts,
                note=DISCARDED_UNUSED,
                permanent=counts_when_discarded(result),
                page=self.version,
            )
            if handed is not None:
                handed.add(index)

    def _commit_run(
        self,
        plan: PagePlan,
        run: Sequence[tuple[SegmentCommit, int]],
        expected: CheckpointState | None,
        report: PageReport,
        handed: set[int] | None = None,
    ) -> CheckpointState | None:
        """Commit consecutive segments in one transaction; the checkpoint they moved to. Their indexes go
        into ``handed`` as the store is asked (it keeps the spend of a commit it refuses)."""
        if not run:
            return expected
        if self.lease is not None:
            self.lease()  # LeaseLostError: the caller keeps the spend of what it was not handed
        skipped = expected.skipped if expected else ()
        for commit, index in run:
            if commit.skip is not None:
                skipped = (*skipped, skipped_record(plan.messages, commit.place.segment, plan.ends[index]))
        last_commit, last = run[-1]
        end = plan.ends[last]
        new = CheckpointState(
            end, plan.hasher.digest(end), last_commit.first_row + len(last_commit.facts), skipped
        )
        terminal: Terminal = "keep"
        if last == len(plan.segments) - 1:
            terminal = "set"
        elif run[0][1] == 0 and plan.checkpoint is not None:
            terminal = "clear"  # appended messages: the page is incomplete until its last new segment
        # One span per transaction: it covers len(run) consecutive segments from the first's index.
        attributes = {**segment_attributes(run[0][0].place), "factmill.segments": len(run)}
        if handed is not None:
            handed.update(index for _, index in run)
        with tracing.span("segment commit", attributes):
            inserted = self.store.commit_segments(
                [commit for commit, _ in run],
                fingerprint=self.planner.fingerprint,
                expected=expected,
                new=new,
                terminal=terminal,
                page=plan.version,
            )
            tracing.annotate("factmill.facts.inserted", inserted)
        self.facts_committed(plan.slug, inserted)
        self.counters.facts_inserted += inserted
        report.facts += inserted
        for commit, _ in run:
            if commit.skip is not None:
                self.count_skip(report, plan.slug)
                continue
            self.counters.segments_processed += 1
            self.counters.facts_extracted += len(commit.facts)
            report.segments += 1
            self.progress.segment_finished(plan.slug, "ok")
        return new

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
        self.facts_committed(place.slug, inserted)
        return inserted

    def _commit_replacing(self, plan: PagePlan, batches: ResultBatches) -> PageReport:
        """Re-extract the page and swap its facts in one transaction, only if every segment succeeded."""
        report = PageReport(plan.slug, "processed")
        held = _Held()
        for batch in batches:
            handed: set[int] = set()  # indexes whose attempts are recorded (held, or discarded)
            try:
                failed = self._hold_batch(plan, batch, report, held, handed)
            except BaseException:
                # Holding one failed (a deadlock, a timeout, the connection dropped, a SIGTERM): the rest
                # of the batch was taken from the feed and paid for too, and nothing else records it.
                self.keep_after_failure(plan.slug, batch, handed)
                raise
            if failed is not None:
                # Answered, held for a swap that will not come (the outage clock's "went forward": None).
                failed.held = failed.segments + failed.skipped
                failed.skipped = 0  # its held skips go in only with a swap: none (no `--skipped` to offer)
                return failed
        segment_facts, skips, skipped = held.segment_facts, held.skips, held.skipped
        missing = len(plan.segments) - report.segments - report.skipped
        if missing:
            # The results ran out (a batch that expired): swapping now would drop the page's later facts.
            self.store.release_held()
            report.status, report.skipped = "incomplete", 0
            report.reason = f"{missing} segment(s) had no result; the earlier facts were kept"
            return report
        end = plan.ends[-1]
        total = sum(len(facts) for _, facts in segment_facts)
        last = self.planner.place(plan.slug, len(plan.segments) - 1, plan.segments[-1])
        if self.lease is not None:  # (see _commit_run): a lapsed run swaps nothing in
            try:
                self.lease()
            except BaseException:
                self.store.release_held()  # what was held for the swap is recorded on its own
                raise
        with tracing.span("page replace", {**segment_attributes(last), "factmill.segments": report.segments}):
            inserted = self.store.replace_page(
                self.planner.fingerprint,
                last,
                segment_facts,
                CheckpointState(end, plan.hasher.digest(end), total, tuple(skipped)),
                page=plan.version,
                skips=skips,
                planned=plan.checkpoint,
            )
        self.counters.segments_processed += report.segments
        self.counters.segments_skipped += len(skips)  # moved past now, with the swap
        self.counters.facts_extracted += total
        self.facts_committed(plan.slug, inserted, replaced=True)
        self.counters.facts_inserted += inserted
        report.facts = inserted
        return report

    def _hold_batch(
        self,
        plan: PagePlan,
        batch: Sequence[SegmentResult3],
        report: PageReport,
        held: _Held,
        handed: set[int],
    ) -> PageReport | None:
        """Hold one batch of results for the swap; the page's report when a failed segment ended it."""
        for position, (index, segment, result) in enumerate(batch):
            place = self.planner.place(plan.slug, index, segment)
            skip, failures = self.poison(place, result)
            self.store.hold_attempts(place, result.attempts, permanent=result.permanent, page=plan.version)
            handed.add(index)
            if skip is not None:  # its skipped row goes in with the swap that moves past it
                held.skips.append((place, result.attempts, skip))
                held.skipped.append(skipped_record(plan.messages, segment, plan.ends[index]))
                report.skipped += 1  # (the run's count once the swap commits: it may not)
                self.progress.segment_finished(plan.slug, "skipped")
                continue
            self.progress.segment_finished(plan.slug, result.outcome)
            if not result.ok:
                self.store.release_held()
                self.discard(plan.slug, batch[position + 1 :], handed)
                tail = "; the page's earlier facts were kept"
                return self.fail_page(report, index, result, tail, failures=failures)
            held.segment_facts.append((place, result.facts))
            report.segments += 1
        return None


@dataclass
class _Held:
    """What a whole-page re-extraction holds for its swap: each segment's facts, and the skipped ones."""

    segment_facts: list[tuple[SegmentPlace, Sequence[ExtractedFact]]] = field(default_factory=list)
    skips: list[tuple[SegmentPlace, Sequence[Attempt], str]] = field(default_factory=list)
    skipped: list[SkippedSegment] = field(default_factory=list)


def segment_attributes(place: SegmentPlace, *, skipped: bool = False) -> dict[str, str | int | bool]:
    """What a commit's span says about the segment: ids and positions, never page text or the slug
    (which can name a person, and which no erasure can take out of a trace store)."""
    attributes: dict[str, str | int | bool] = {
        "factmill.source": place.source_id,
        "factmill.segment.index": place.index,
        "factmill.segment.skipped": skipped,
        "factmill.segments": 1,
    }
    if place.job_id is not None:
        attributes["factmill.job.id"] = place.job_id
    return attributes
