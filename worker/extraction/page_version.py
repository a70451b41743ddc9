"""The page a run planned from, and the check every commit makes that the page still holds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Page
from worker.core.checkpoint import CheckpointState, prefix_digests
from worker.core.conversation import iter_conversation_messages
from worker.extraction.erase import page_body
from worker.extraction.options import PageChangedError, PageErasedError
from worker.extraction.statements import PAGE_VERSION


@dataclass(frozen=True)
class PageVersion:
    """The page as a run planned it: a commit stores facts only while the page still says what they
    were drawn from (erased, emptied or edited since: PageChangedError, nothing stored)."""

    page_id: int
    content_hash: str
    types: tuple[str, ...]  # the page types the run extracts
    # (messages, their prefix digest): what the run planned from, computed when first asked
    planned: Callable[[], tuple[int, str]] | None = None
    # Versions found to hold every planned message unchanged (appended to): a later commit of the run
    # takes them on their hash. Each commit re-read and re-parsed the whole body (megabytes) before.
    appended: set[str] = field(default_factory=set, compare=False)


def page_erased(session: Session, page_id: int) -> bool:
    """Whether the page is gone (erased), its row held ``FOR SHARE`` to the end of the caller's
    transaction when it is not: what is recorded for it then names a page that still exists (an
    erasure's own transaction is waited out, then seen)."""
    return session.execute(PAGE_VERSION, {"page_id": page_id}).first() is None


def check_page(session: Session, page: PageVersion, slug: str, new: CheckpointState) -> None:
    """Hold the page row ``FOR SHARE`` for the commit and raise PageChangedError unless the facts still
    describe it: unchanged, or changed only past the messages the new checkpoint covers (an append) and
    still of an extracted type. Erasure and ``store_page`` hold the row ``FOR UPDATE`` while they drop
    its facts, so a commit runs wholly before them (and is dropped with the rest) or sees their result."""
    # The hash first: the body (megabytes for a long chat) is read only when the page did change.
    # Core statements on the tables in the commit path: ORM-enabled ones cost several times as much
    # Python per call (py-spy, bench/pipeline.py).
    row = session.execute(PAGE_VERSION, {"page_id": page.page_id}).one_or_none()
    if row is None:
        raise PageErasedError(f"{slug!r} was erased while it was extracted; its facts were not stored")
    if row.content_hash == page.content_hash or (
        row.content_hash in page.appended and row.type in page.types
    ):
        return
    if row.type not in page.types:
        raise PageChangedError(_CHANGED.format(slug=slug))
    # Read as a stream up to the messages the run planned from: the page's run holds its own parse
    # already (what page memory counted), and a second whole parse here (4.5 times the body, uncounted)
    # came on every commit after each append to a live chat.
    parts = session.execute(
        select(Page.compiled_truth, Page.timeline).where(Page.id == page.page_id)
    ).one()  # the row is held FOR SHARE already
    body = page_body(parts.compiled_truth, parts.timeline)
    del parts
    planned = page.planned() if page.planned is not None else None
    counts = (new.messages_done, planned[0]) if planned is not None else (new.messages_done,)
    digests = prefix_digests(iter_conversation_messages(body), counts)
    if digests.get(new.messages_done) != new.prefix_hash:
        raise PageChangedError(_CHANGED.format(slug=slug))
    if planned is not None and digests.get(planned[0]) == planned[1]:
        page.appended.add(row.content_hash)


_CHANGED = (
    "{slug!r} changed while it was extracted and no longer holds the messages these facts came from; "
    "they were not stored"
)
