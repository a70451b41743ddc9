"""`jobs retry --skipped`: re-extract a page's skipped (poison) segments, in page order, each committed
exactly once (its facts take the page's next row numbers, and the skip mark goes with that commit)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.core.checkpoint import CheckpointState, PrefixHasher, SkippedSegment, segment_hash
from worker.core.conversation import Segment, parse_conversation_messages, segment_of
from worker.extraction.committer import SegmentCommitter
from worker.extraction.options import ExtractionCounters, PageReport, page_types
from worker.extraction.planner import PagePlanner
from worker.extraction.rows import SegmentPlace
from worker.extraction.segments import DISCARDED_ABORTED, SegmentAbortedError, SegmentResult
from worker.extraction.store import ExtractionStore, PageRef, PageVersion

logger = logging.getLogger(__name__)

# One segment's LLM attempts: (the page's label, the segment) -> its result.
ExtractOne = Callable[[str, Segment], SegmentResult]


class SkippedRetry:
    """Re-extracts the skipped segments the checkpoint lists, through the committer's rules."""

    def __init__(
        self,
        store: ExtractionStore,
        planner: PagePlanner,
        committer: SegmentCommitter,
        counters: ExtractionCounters,
        extract: ExtractOne,
    ) -> None:
        self.store, self.planner, self.committer = store, planner, committer
        self.counters, self.extract = counters, extract

    def retry_page(self, ref: PageRef) -> PageReport | None:
        """The page's report for this pass, or None when it has nothing skipped (or was edited since:
        the normal plan then re-extracts it whole, skipped segments included)."""
        options = self.planner.options
        stored = self.store.load_page(
            ref.page_id, self.planner.fingerprint, options.source_id, ref.slug, with_checkpoint=True
        )
        if stored is None or stored.checkpoint is None or not stored.checkpoint.skipped:
            return None
        checkpoint = stored.checkpoint
        messages = parse_conversation_messages(stored.body)
        if (
            checkpoint.messages_done > len(messages)
            or PrefixHasher(messages).digest(checkpoint.messages_done) != checkpoint.prefix_hash
        ):
            return None
        version = PageVersion(ref.page_id, stored.content_hash, page_types(self.planner.config))
        report = PageReport(ref.slug, "processed")
        self.committer.progress.page_started(ref.slug, len(checkpoint.skipped))
        for index, entry in enumerate(checkpoint.skipped):
            segment = segment_of(entry.messages_of(messages))
            if segment_hash(segment) != entry.segment_hash:  # cannot happen while the prefix is unchanged
                logger.warning(  # the page by id: a slug can name a person, and logs name none
                    "skipped segment %s of page %s no longer matches its record", entry.first, ref.page_id
                )
                continue
            place = self.planner.place(ref.slug, index, segment)  # index: its place among the skipped
            checkpoint, failed = self._retry_one(report, stored.label, checkpoint, entry, place, version)
            if failed:
                break
        return report

    def _retry_one(
        self,
        report: PageReport,
        label: str,
        expected: CheckpointState,
        entry: SkippedSegment,
        place: SegmentPlace,
        version: PageVersion,
    ) -> tuple[CheckpointState, bool]:
        """Extract one skipped segment and commit what came of it: (the checkpoint now, whether the
        page failed and the pass stops)."""
        slug = report.slug
        try:
            result = self.extract(label, place.segment)
        except SegmentAbortedError as aborted:  # paid attempts, then an error: recorded, then raised on
            self.counters.add_calls(SegmentResult(aborted.attempts))
            self.store.record_attempts(place, aborted.attempts, note=DISCARDED_ABORTED, page=version)
            raise aborted.cause from None
        self.counters.add_calls(result)
        try:
            skip, failures = self.committer.poison(place, result)
        except BaseException:  # its count unread (the database away): the paid retry is still recorded
            self.committer.keep_after_failure(slug, [(place.index, place.segment, result)], set())
            raise
        if not result.ok and skip is None:
            self.store.record_attempts(place, result.attempts, permanent=result.permanent, page=version)
            self.committer.progress.segment_finished(slug, result.outcome)
            self.committer.fail_page(report, place.index, result, " (a skipped segment)", failures)
            return expected, True
        remaining = expected.skipped if skip is not None else tuple(e for e in expected.skipped if e != entry)
        new = CheckpointState(
            expected.messages_done, expected.prefix_hash, expected.next_row_num + len(result.facts), remaining
        )
        if self.committer.lease is not None:
            try:
                self.committer.lease()  # a lapsed run commits nothing more (SegmentCommitter.lease)
            except BaseException:
                self.store.record_attempts(place, result.attempts, permanent=result.permanent, page=version)
                raise
        inserted = self.committer.commit(
            place, result, expected=expected, new=new, terminal="keep", page=version, skip=skip
        )
        if skip is not None:
            self.committer.count_skip(report, slug)
            return new, False
        self.counters.segments_unskipped += 1
        self.counters.segments_processed += 1
        self.counters.facts_extracted += len(result.facts)
        self.counters.facts_inserted += inserted
        report.segments += 1
        report.facts += inserted
        self.committer.progress.segment_finished(slug, "ok")
        return new, False
