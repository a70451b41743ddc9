"""Reading page files (Markdown with YAML front matter) and storing them as pages."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from models import Page
from worker.core.conversation import MAX_PAGE_BODY_BYTES
from worker.db import made_again_on_deadlock
from worker.extraction.pages import MAX_FRONT_MATTER_DEPTH, PageIn, StaleDeliveryError, store_page
from worker.jobs.outbox import EXTRACTION, JobRequest

logger = logging.getLogger(__name__)

PAGE_SUFFIXES = (".md", ".markdown", ".txt")
FRONT_MATTER_KEYS = ("slug", "type", "title", "source_id")


class PageFileError(ValueError):
    """A file that cannot become a page; the message says why and what to fix."""


@dataclass
class IngestReport:
    ingested: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    jobs: list[tuple[int, str]] = field(default_factory=list)  # (job id, kind) of the changed pages
    # The jobs this run created, to enqueue after the commit (a pending one has its message already).
    created: list[tuple[int, str]] = field(default_factory=list)
    enqueued: int = 0  # of those, how many ``send`` handed to the broker


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class _FrontMatterLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader without aliases and with a cap on nesting.

    An alias repeats a value wherever it is named: nine lines of them in 554 bytes stood for 387
    million values, which ``safe_load`` returns as shared references and anything that walks them (the
    stored front matter, its JSON) expands. Each level of nesting is a level of the composer's
    recursion: 900 ``[`` ended the whole ingest in a RecursionError.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        line = self.peek_event().start_mark.line + 2  # the file's line: the front matter opens at 2
        if self.check_event(yaml.AliasEvent):
            raise PageFileError(f"front matter uses a YAML alias (line {line}); write the value out instead")
        if self._depth >= MAX_FRONT_MATTER_DEPTH and self.check_event(
            yaml.SequenceStartEvent, yaml.MappingStartEvent
        ):
            raise PageFileError(
                f"front matter nests deeper than {MAX_FRONT_MATTER_DEPTH} levels (line {line})"
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# A page file's front matter: its metadata, never the conversation. PyYAML is pure Python: 2 MB of it
# took 19 s and 676 MB to parse, and a file under the page cap could hold 25 MiB.
MAX_FRONT_MATTER_BYTES = 64 * 1024


_STR_TAG = "tag:yaml.org,2002:str"


def _load_front_matter(raw: str) -> Any:
    """The front matter's YAML, its title as written: YAML 1.1 read "title: On" as True, "1:30" as 90
    and "3.10" as 3.1 (stored so, and the model's page label said so); a title is text."""
    loader = _FrontMatterLoader(raw)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    if isinstance(node, yaml.MappingNode) and isinstance(data, dict) and data.get("title") is not None:
        titles = [value for key, value in node.value if key.value == "title"]
        last = titles[-1] if titles else None  # YAML's value of a repeated key is its last
        if isinstance(last, yaml.ScalarNode) and last.style is None and last.tag != _STR_TAG:
            data["title"] = last.value  # a plain scalar: its text, whatever YAML typed it as
    return data or {}


def _split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    if not text.startswith("---"):
        return {}, text
    lines = text.splitlines(keepends=True)
    if lines[0].strip() != "---":
        return {}, text
    for index in range(1, len(lines)):
        # At the line's start only: an indented "---" is text of a block value (it closed the front
        # matter there, the value cut and the rest of the front matter taken as the body).
        if lines[index].rstrip() in ("---", "..."):
            raw = "".join(lines[1:index])
            if (size := len(raw.encode("utf-8", "surrogatepass"))) > MAX_FRONT_MATTER_BYTES:
                raise PageFileError(
                    f"front matter is {size:,} bytes, over its cap of {MAX_FRONT_MATTER_BYTES:,} "
                    f"({MAX_FRONT_MATTER_BYTES // 1024} KiB); "
                    "keep it to the page's metadata and put the conversation in the body"
                )
            try:
                data = _load_front_matter(raw)
            except yaml.YAMLError as exc:
                raise PageFileError(f"front matter is not valid YAML: {exc}") from exc
            except PageFileError:
                raise  # the loader's own (an alias, too deep)
            except (ValueError, OverflowError) as exc:  # a value PyYAML parses but Python cannot hold:
                # 2024-02-30, year 0, an offset of +25:00, an integer of 4,300 digits or more
                raise PageFileError(f"front matter holds a value that cannot be read: {exc}") from exc
            if not isinstance(data, dict):
                raise PageFileError("front matter must be a YAML mapping (key: value lines)")
            return data, "".join(lines[index + 1 :])
    raise PageFileError("front matter opened with '---' is never closed")


# A page file's body may be as long as a webhook's, plus its front matter.
MAX_PAGE_FILE_BYTES = MAX_PAGE_BODY_BYTES + MAX_FRONT_MATTER_BYTES

_NOT_REGULAR = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _read_page_bytes(path: Path) -> bytes:
    """The file's bytes, no further than the cap (a path may be huge). Only a regular file is read: a
    named pipe or a terminal (/dev/tty) blocked the run forever on its open or its read, the files
    after it never ingested, and a device such as /dev/zero has no end."""
    # O_NONBLOCK: opening a named pipe for reading otherwise waits for a writer before fstat can tell.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        for is_kind, kind in _NOT_REGULAR:
            if is_kind(mode):
                raise PageFileError(f"not a regular file ({kind}); write the page to a file and ingest that")
        return file.read(MAX_PAGE_FILE_BYTES + 1)


def load_page_file(path: Path, root: Path | None = None, source_id: str = "default") -> PageIn:
    """Read one page file; the slug defaults to the path below ``root`` without its suffix."""
    raw = _read_page_bytes(path)
    if len(raw) > MAX_PAGE_FILE_BYTES:
        raise PageFileError(
            f"file is over {MAX_PAGE_FILE_BYTES} bytes, past the page cap ({MAX_PAGE_BODY_BYTES} bytes of "
            f"body and {MAX_FRONT_MATTER_BYTES // 1024} KiB of front matter)"
        )
    if b"\x00" in raw:
        raise PageFileError("file contains NUL bytes; it looks binary, not a text page")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PageFileError(f"file is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    meta, body = _split_front_matter(text)
    if "type" not in meta:
        raise PageFileError("front matter has no 'type' (e.g. type: conversation)")
    for key in ("source_id", "slug", "type", "title"):
        # YAML reads "slug: 007" as 7 and a blank value as null: stored as "7" or "None" (a blank
        # source_id overrode --source, a blank type passed as a page of type "none"). A title is kept as
        # written (_load_front_matter); a list, a mapping or a tagged value is no title (blank: none).
        if key in meta and not isinstance(meta[key], str) and not (key == "title" and meta[key] is None):
            got = "nothing" if meta[key] is None else repr(meta[key])
            raise PageFileError(
                f"front matter '{key}' must be text, got {got}; quote it (e.g. {key}: \"007\")"
            )
    slug = meta.get("slug")
    if slug is None:
        slug = path_slug(path, root)
        if not _utf8(slug):  # a Latin-1 file name: its bytes reach Python as lone surrogates
            raise PageFileError(
                "the file name is not UTF-8, so no slug can be made of it; give the page a 'slug:' in its "
                "front matter (or rename the file)"
            )
    extra = {k: v for k, v in meta.items() if k not in FRONT_MATTER_KEYS}
    try:
        page = PageIn(
            source_id=meta.get("source_id", source_id),
            slug=slug,
            type=meta["type"],
            title=str(meta.get("title") or ""),
            compiled_truth=body.lstrip("\n"),
            frontmatter=_jsonable(extra),
        )
    except ValidationError as exc:
        problems = "; ".join(
            ": ".join(
                [
                    *([".".join(map(str, e["loc"]))] if e["loc"] else []),
                    e["msg"].removeprefix("Value error, "),
                ]
            )
            for e in exc.errors()
        )
        raise PageFileError(problems) from exc
    return page


def path_slug(path: Path, root: Path | None) -> str:
    """The slug a page file without a 'slug:' gets: its path below ``root`` (or its name), no suffix."""
    base = path.relative_to(root) if root and path.is_relative_to(root) else Path(path.name)
    return base.with_suffix("").as_posix()


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown_path(path: Path | str) -> str:
    """A path as a report shows it: a name that is not UTF-8 keeps its bytes as ``\\xe9`` escapes (its
    lone surrogates stopped ``ingest --json`` with a traceback, the report never written)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _is_page_file(path: Path) -> bool:
    return path.suffix.lower() in PAGE_SUFFIXES and path.name.lower() != "readme.md"


def _walk(root: Path, on_error: Callable[[Path, str], None] | None) -> list[Path]:
    """The page files under ``root``, sorted. Symlinked directories are followed (once each: a link to
    a parent is no loop); a directory that cannot be read is reported to ``on_error`` (rglob skipped
    both without a word, so their files were never ingested and the run said nothing was wrong)."""
    found: list[Path] = []
    seen: set[str] = set()

    def unreadable(exc: OSError) -> None:
        if on_error is not None:
            on_error(Path(exc.filename or root), f"cannot read the directory ({exc.strerror or exc})")

    real_root = os.path.realpath(root)
    for folder, dirs, files in os.walk(root, onerror=unreadable, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        # A link to a folder inside the root is not followed: that folder is walked under its own name.
        # Followed, whichever the directory listing gave first won (root/latest -> root/2024-06 made the
        # pages "latest/..." on one machine and "2024-06/..." on another), and sorted, links to one
        # folder outside the root are walked in the same order everywhere.
        dirs[:] = sorted(name for name in dirs if not _links_inside(os.path.join(folder, name), real_root))
        for name in files:
            if not _is_page_file(path := Path(folder, name)):
                continue
            try:
                regular = path.is_file()
            except OSError as exc:  # EACCES: a folder that can be listed but not entered
                if on_error is not None:
                    on_error(path, f"cannot be read ({exc.strerror or exc})")
                continue
            if regular:
                found.append(path)
            elif on_error is not None and not name.startswith("."):
                # A named pipe, a socket, a link to nothing: skipped without a word. Not a hidden one: an
                # editor's lock (Emacs's .#page.md, a link to nowhere) failed the run of a healthy folder.
                on_error(path, "not a regular file (a named pipe, socket or broken link); not read")
    return sorted(found)


def _links_inside(path: str, real_root: str) -> bool:
    """Whether ``path`` is a symlink to a folder inside ``real_root`` (the root itself included)."""
    if not os.path.islink(path):
        return False
    target = os.path.realpath(path)
    return target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep)


def iter_page_files(
    paths: Iterable[Path], on_error: Callable[[Path, str], None] | None = None
) -> Iterator[tuple[Path, Path | None]]:
    """Each file to ingest with the root its slug is relative to; directories are walked recursively
    (a directory that cannot be read is reported to ``on_error``)."""
    for path in paths:
        if path.is_dir():
            for child in _walk(path, on_error):
                yield child, path
        else:
            yield path, None


def ingest_paths(
    factory: sessionmaker[Session],
    paths: Iterable[Path],
    source_id: str = "default",
    on_file: Callable[[Path], None] | None = None,
    send: Callable[[list[tuple[int, str]]], int] | None = None,
    replace: bool = False,
) -> IngestReport:
    """Store every readable page and its extraction job (one transaction per page, the webhook's outbox
    path); a bad file is reported and the rest still go in. ``send`` (worker.jobs.sending.enqueue) hands
    each created job to the broker as its page commits: sent all at the end of a long ingest, every job
    went twice, as the sweeper had sent those waiting unsent meanwhile. Without it the sweeper sends
    them. ``on_file`` hears of each file once it is done with (stored, unchanged or refused). A page
    another file stored, that file still there, is refused unless ``replace`` (``_OtherFileError``)."""
    report = IngestReport()
    taken: dict[tuple[str, str], Path] = {}  # each page of this run: the file it came from
    files: dict[str, str] = {}  # each file of this run (its real path): the slug it was stored under

    def unreadable(path: Path, reason: str) -> None:
        report.errors.append((shown_path(path), reason))

    for path, root in iter_page_files(paths, on_error=unreadable):
        created = len(report.created)
        _ingest_file(factory, path, root, source_id, report, taken, files, replace=replace)
        if send is not None and len(report.created) > created:
            asked = report.created[created:]
            sent = send(asked)
            report.enqueued += sent
            if sent < len(asked):  # the broker is away: each try waits on it; the sweeper sends the rest
                send = None
        if on_file is not None:
            on_file(path)
    return report


def _ingest_file(
    factory: sessionmaker[Session],
    path: Path,
    root: Path | None,
    source_id: str,
    report: IngestReport,
    taken: dict[tuple[str, str], Path],
    files: dict[str, str],
    *,
    replace: bool,
) -> None:
    try:
        page = load_page_file(path, root, source_id)
    except FileNotFoundError:
        report.errors.append((shown_path(path), "no such file or directory"))
        return
    except (PageFileError, OSError) as exc:
        report.errors.append((shown_path(path), str(exc)))
        return
    first = taken.setdefault((page.source_id, page.slug), path)
    if first != path:
        # Two files of one run, one page (a/chat.md and b/chat.md; x.md and x.txt): the second silently
        # replaced the first, whose text was gone, and the run said both were ingested.
        report.errors.append(
            (
                shown_path(path),
                f"same page as {shown_path(first)} (slug {page.slug!r}); "
                "give one a 'slug:' in its front matter",
            )
        )
        return
    # One file reached twice (`ingest notes notes/2024`): its slugs differ (relative to each root), and
    # both pages were stored and extracted, every fact twice.
    real = os.path.realpath(path)
    again = files.setdefault(shown_path(real), page.slug)
    if again != page.slug:
        report.errors.append((shown_path(path), f"the same file as page {again!r}, ingested once"))
        return
    try:
        # Dated by the database's clock (which dates erasures; an operator's laptop's may be off):
        # undated, it was undone by a sender's retry of an older delivery (signed before this ingest,
        # it still passed the page's newest-delivery check). A deadlock with a delivery emptying pages
        # of the same entities is made again, as the delivery is (it stopped the run mid-folder).
        # A name that is not UTF-8 cannot be stored (nor found again): such a file goes unnoted.
        origin = _FileOrigin(real if _utf8(real) else None, page.slug == path_slug(path, root), replace)
        job = made_again_on_deadlock(_store_dated, factory, page, origin)
    except (_OtherFileError, _SameFileError) as exc:
        report.errors.append((shown_path(path), exc.said(page.slug)))
        return
    except StaleDeliveryError as exc:  # erased while it waited, or stored by a delivery dated later
        at = exc.stored_at.isoformat() if exc.stored_at is not None else "a later time"
        said = (
            f"the page was erased ({at}) while this ingest ran; not stored: ingest it again to store it anew"
            if exc.erased
            else f"a delivery dated {at}, later than this ingest (its sender's clock is ahead), stored this "
            "page; not replaced: ingest it again after that time"
        )
        report.errors.append((shown_path(path), said))
        return
    if job is None:
        report.unchanged.append(page.slug)
    else:
        report.ingested.append(page.slug)
        report.jobs.append((job.job_id, EXTRACTION))
        if job.created:
            report.created.append((job.job_id, EXTRACTION))


class _SameFileError(Exception):
    """This file was stored as another page (another slug), which is still there."""

    def __init__(self, slug: str) -> None:
        super().__init__(slug)
        self.slug = slug

    def said(self, slug: str) -> str:
        return (
            f"this file is stored as page {self.slug!r} (its slug relative to the folder it was ingested "
            f"from); not stored again as {slug!r}: ingest that folder, give the file a 'slug:', or pass "
            "--replace to store it as a page of its own"
        )


@dataclass(frozen=True)
class _FileOrigin:
    """Where a page file came from: its real path (None: not UTF-8), whether its slug is that path's
    (not a 'slug:' of its own), and whether ``--replace`` was given."""

    path: str | None
    slug_by_path: bool
    replace: bool


class _OtherFileError(Exception):
    """The page was stored from another file, which is still there."""

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        self.origin = origin

    def said(self, slug: str) -> str:
        return (
            f"page {slug!r} was stored from {self.origin}, another file that is still there; not replaced: "
            "give this one a 'slug:' of its own in its front matter, or pass --replace to store it over "
            "that page"
        )


def _store_dated(factory: sessionmaker[Session], page: PageIn, file: _FileOrigin) -> JobRequest | None:
    """``store_page`` in a transaction of its own, dated by the database's clock, and the page's file
    noted. A slug is a path below the folder named, so two folders' general.md are one page: a page
    another file stored is not replaced while that file is there (it moved, or this is another machine:
    replaced, as an edit of it would be)."""
    where = (Page.source_id == page.source_id, Page.slug == page.slug)
    origin = file.path
    with factory.begin() as session:
        stored = session.scalar(select(Page.origin).where(*where))
        checked = stored != origin and not file.replace
        if checked and stored is not None and os.path.isfile(stored):
            raise _OtherFileError(stored)
        if checked and origin is not None and file.slug_by_path:
            # This file stored under another slug (`ingest notes`, then `ingest notes/2024/chat.md`):
            # a second page of one conversation, extracted and paid for twice, found twice.
            other = session.scalar(
                select(Page.slug).where(Page.source_id == page.source_id, Page.origin == origin).limit(1)
            )
            if other is not None:
                raise _SameFileError(other)
        job = store_page(session, page, session.scalar(select(func.now())))
        if origin is not None and stored != origin:
            session.execute(update(Page).where(*where).values(origin=origin))
        return job
