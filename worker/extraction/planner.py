"""Which pages a run extracts and, per page, the segments after its checkpoint (the page plan)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.config_store import ConfigReader
from worker.core.checkpoint import (
    CheckpointState,
    PrefixHasher,
    extract_conversation_facts_fingerprint,
    resume_point,
    segment_ends,
    with_leading_orphan,
)
from worker.core.conversation import (
    MAX_PAGE_BODY_BYTES,
    Message,
    Segment,
    instant_micros,
    parse_conversation_messages,
    split_into_segments,
)
from worker.extraction.options import ExtractOptions, PageReport, page_types
from worker.extraction.store import ExtractionStore, PageRef, PageVersion, SegmentPlace


@dataclass(frozen=True)
class PagePlan:
    """One page's pending work: the segments after its checkpoint, and how to commit them."""

    page_id: int
    slug: str
    label: str
    hasher: PrefixHasher
    segments: Sequence[Segment]
    ends: Sequence[int]  # per segment, the message index just past it (the checkpoint it advances to)
    checkpoint: CheckpointState | None  # as planned: each commit compares and sets it
    replace: bool  # force, or an edited page: all segments must succeed, then the facts are swapped
    version: PageVersion | None = None  # what the commits check the page against (None: no check)
    messages: Sequence[Message] = ()  # the page's (a skipped segment's record names them by index)


class PagePlanner:
    """Lists a run's pages and plans each one; reads only, through the store."""

    def __init__(self, store: ExtractionStore, options: ExtractOptions, config: ConfigReader) -> None:
        self.store = store
        self.options = options
        self.config = config
        self.fingerprint = extract_conversation_facts_fingerprint(options.source_id)

    def pages(self) -> list[PageRef]:
        """The run's conversation pages (one source, or one page of it), by slug."""
        return self.store.list_pages(self.options.source_id, page_types(self.config), self.options.slug)

    def place(self, slug: str, index: int, segment: Segment) -> SegmentPlace:
        return SegmentPlace(self.options.job_id, self.options.source_id, slug, index, segment)

    def plan(self, ref: PageRef) -> PagePlan | PageReport:
        """The page's segments after its checkpoint, or a report saying why there is nothing to do."""
        slug = ref.slug
        if ref.size > MAX_PAGE_BODY_BYTES:
            return PageReport(
                slug,
                "skipped_too_large",
                f"body is {ref.size} bytes, over the {MAX_PAGE_BODY_BYTES}-byte cap",
            )
        force = self.options.force
        stored = self.store.load_page(
            ref.page_id, self.fingerprint, self.options.source_id, slug, with_checkpoint=True
        )
        if stored is None:
            return PageReport(slug, "skipped", "the page was deleted before it could be extracted")
        label, checkpoint = stored.label, stored.checkpoint
        messages = parse_conversation_messages(stored.body)
        if not messages:
            return PageReport(
                slug, "skipped", "no message lines (expected **Name** (YYYY-MM-DD H:MM AM): text)"
            )
        hasher = PrefixHasher(messages)
        version = PageVersion(
            ref.page_id, stored.content_hash, page_types(self.config), PlannedDigest(messages)
        )
        del stored  # the body may be large: keep only its messages
        # A forced run starts over, but keeps the checkpoint it saw: its swap is refused if another run
        # moves it on meanwhile (it would take that run's facts out and move the checkpoint back).
        start, edited = resume_point(messages, hasher, None if force else checkpoint)
        # An edited page's facts are all replaced: it is extracted whole, ``since`` or not (narrowed, the
        # replacement deleted the facts from before ``since`` and moved the checkpoint past them).
        since = None if edited else self.options.since_iso
        segments = split_into_segments(messages[start:], since_iso=since)
        # Resuming: a conversation's last message left alone joins the first segment (with --since too,
        # when it is after it: else the checkpoint moved past it and no run ever sent it).
        if 0 < start < len(messages) and (
            since is None or instant_micros(messages[start].timestamp) > instant_micros(since.strip())
        ):
            segments = with_leading_orphan(messages[start - 1], messages[start:], segments)
        if not segments:
            return PageReport(slug, "skipped", "nothing new since the last extraction")
        if self.options.dry_run:
            return PageReport(slug, "dry_run", "", segments=len(segments))
        ends = segment_ends(messages, start, segments)
        return PagePlan(
            ref.page_id, slug, label, hasher, segments, ends, checkpoint, force or edited, version, messages
        )


class PlannedDigest:
    """(how many, their prefix digest) of the messages a run planned from, computed once if a commit
    finds the page changed (a pass over every message that a run with no append never needs); the
    messages are let go once it is (a page's version outlives its plan)."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self._messages: Sequence[Message] | None = messages
        self._digest: tuple[int, str] | None = None

    def __call__(self) -> tuple[int, str]:
        if self._digest is None:
            messages = self._messages or ()
            self._digest = (len(messages), PrefixHasher(messages).digest(len(messages)))
            self._messages = None
        return self._digest
