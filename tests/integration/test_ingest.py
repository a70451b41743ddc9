"""Ingesting page files into the store (the path `factmill ingest` takes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import Page
from tests.locks import waits_on_a_lock
from worker.extraction.ingest import ingest_paths

pytestmark = pytest.mark.integration


def test_ingest_tells_of_every_file_it_is_done_with(tmp_path: Path, tx_factory) -> None:  # type: ignore[no-untyped-def]
    """`factmill ingest` advances its progress bar by it: stored, unchanged and refused files alike."""
    (tmp_path / "a.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    (tmp_path / "b.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Bo: hi\n")
    (tmp_path / "bad.md").write_text("no front matter\n")
    heard: list[str] = []
    report = ingest_paths(tx_factory, [tmp_path], "files", on_file=lambda path: heard.append(path.name))
    assert heard == ["a.md", "b.md", "bad.md"] and report.ingested == ["a", "b"] and len(report.errors) == 1
    again = ingest_paths(
        tx_factory, [tmp_path / "a.md"], "files", on_file=lambda path: heard.append(path.name)
    )
    assert heard[-1] == "a.md" and again.unchanged == ["a"]


def test_a_changed_file_whose_job_is_still_pending_is_not_sent_again(tx_factory, tmp_path: Path) -> None:
    """Its job has a message already: sent again it skipped a retry's backoff (the sweeper sends one
    whose message was lost)."""
    page = tmp_path / "a.md"
    page.write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    first = ingest_paths(tx_factory, [page], "files")
    page.write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hello\n")
    second = ingest_paths(tx_factory, [page], "files")
    assert first.created == first.jobs and second.jobs == first.jobs and second.created == []


def test_two_files_of_one_page_are_refused_not_one_silently_replacing_the_other(
    tx_factory, tmp_path: Path
) -> None:
    """a/chat.md and b/chat.md given as files (or x.md and x.txt in one folder) are one slug: the second
    replaced the first, whose text was gone, and the run said both were ingested."""
    for folder, speaker in (("a", "Ann"), ("b", "Bo")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "chat.md").write_text(
            f"---\ntype: conversation\n---\n[2024-01-01 10:00] {speaker}: hi\n"
        )
    (tmp_path / "a" / "chat.txt").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Cy: hi\n")
    report = ingest_paths(tx_factory, [tmp_path / "a" / "chat.md", tmp_path / "b" / "chat.md"], "files")
    assert report.ingested == ["chat"]
    assert [(Path(p).parent.name, "same page as" in why) for p, why in report.errors] == [("b", True)]
    walked = ingest_paths(tx_factory, [tmp_path / "a"], "walked")
    assert walked.ingested == ["chat"] and len(walked.errors) == 1
    assert "give one a 'slug:'" in walked.errors[0][1]


def test_a_page_from_another_file_that_is_still_there_is_not_replaced_by_a_later_run(
    tx_factory, tmp_path: Path
) -> None:
    """`ingest exports/2024-06`, then `ingest exports/2024-07`, both holding general.md: the second run
    stored over June's page (and its job replaced June's facts), saying "ingested 1 page"."""
    june, july = tmp_path / "2024-06", tmp_path / "2024-07"
    for folder, speaker in ((june, "Ann"), (july, "Bo")):
        folder.mkdir()
        (folder / "general.md").write_text(
            f"---\ntype: conversation\n---\n[2024-01-01 10:00] {speaker}: hi\n"
        )
    assert ingest_paths(tx_factory, [june]).ingested == ["general"]
    refused = ingest_paths(tx_factory, [july])
    assert refused.ingested == [] and len(refused.errors) == 1
    assert str(june / "general.md") in refused.errors[0][1] and "--replace" in refused.errors[0][1]
    assert "Ann" in stored_body(tx_factory, "general")
    (june / "general.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: bye\n")
    assert ingest_paths(tx_factory, [june]).ingested == ["general"]  # its own file, edited: stored
    assert ingest_paths(tx_factory, [july], replace=True).ingested == ["general"]
    assert "Bo" in stored_body(tx_factory, "general")
    assert ingest_paths(tx_factory, [june]).errors  # now July's page, and July's file is still there
    (july / "general.md").unlink()  # moved away (or another machine): the page's file is gone
    assert ingest_paths(tx_factory, [june]).ingested == ["general"]


def test_a_file_stored_under_one_slug_is_not_stored_again_under_another(tx_factory, tmp_path: Path) -> None:
    """`ingest notes`, then `ingest notes/2024/chat.md` to refresh the one file edited: the second made a
    page "chat" beside "2024/chat", the conversation extracted (and paid for) twice and found twice."""
    (tmp_path / "2024").mkdir()
    chat = tmp_path / "2024" / "chat.md"
    chat.write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    assert ingest_paths(tx_factory, [tmp_path]).ingested == ["2024/chat"]
    chat.write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: bye\n")
    refused = ingest_paths(tx_factory, [chat])
    assert refused.ingested == [] and len(refused.errors) == 1
    assert "stored as page '2024/chat'" in refused.errors[0][1], refused.errors
    assert ingest_paths(tx_factory, [tmp_path]).ingested == ["2024/chat"]  # from the folder: its page
    assert ingest_paths(tx_factory, [chat], replace=True).ingested == ["chat"]
    # A file that names its page is the page it names: renamed by its 'slug:', it is stored as that.
    named = tmp_path / "named.md"
    for slug in ("alice", "bob"):
        named.write_text(f"---\ntype: conversation\nslug: {slug}\n---\n[2024-01-01 10:00] Ann: hi\n")
        assert ingest_paths(tx_factory, [named]).ingested == [slug]


def test_a_file_under_a_path_that_is_not_utf8_does_not_replace_another_files_page(
    tx_factory, tmp_path: Path
) -> None:
    """Its path cannot be stored, so it goes unnoted; it skipped the check too, and replaced the page
    another file (still there) had stored, without a word."""
    import os

    notes, latin = tmp_path / "notes", tmp_path / os.fsdecode(b"caf\xe9")
    for folder, speaker in ((notes, "Ann"), (latin, "Bo")):
        folder.mkdir()
        (folder / "general.md").write_text(
            f"---\ntype: conversation\n---\n[2024-01-01 10:00] {speaker}: hi\n"
        )
    assert ingest_paths(tx_factory, [notes]).ingested == ["general"]
    refused = ingest_paths(tx_factory, [latin])
    assert refused.ingested == [] and "another file that is still there" in refused.errors[0][1]
    assert "Ann" in stored_body(tx_factory, "general")


def stored_body(factory: sessionmaker[Session], slug: str) -> str:
    with factory() as session:
        return session.scalars(select(Page.compiled_truth).where(Page.slug == slug)).one()


def test_a_symlinked_folder_is_walked_once_and_a_link_to_a_parent_is_no_loop(
    tx_factory, tmp_path: Path
) -> None:
    """rglob skipped symlinked folders without a word: their pages were never ingested."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "far.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "back").symlink_to(root, target_is_directory=True)
    report = ingest_paths(tx_factory, [root], "files")
    assert report.ingested == ["linked/far"] and report.errors == []


def test_a_link_to_a_folder_inside_the_root_is_not_walked_in_its_folders_place(
    tx_factory, tmp_path: Path
) -> None:
    """root/latest -> root/2024-06: whichever the directory listing gave first was walked and the other
    passed over, so the pages were "latest/chat" on one machine and "2024-06/chat" on another, and when
    latest moved on, June's pages came back under their own slugs, extracted and paid for again."""
    root = tmp_path / "root"
    (root / "2024-06").mkdir(parents=True)
    (root / "2024-06" / "chat.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    for name in ("0-first", "latest", "z-last"):  # listed before and after the folder, whatever the order
        (root / name).symlink_to(root / "2024-06", target_is_directory=True)
    report = ingest_paths(tx_factory, [root], "files")
    assert report.ingested == ["2024-06/chat"] and report.errors == []


def test_an_entry_that_cannot_be_looked_at_is_reported_and_the_rest_ingested(
    tx_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path.is_file raises on EACCES (a folder listed but not entered): the walk that counts the files
    ended the run, nothing ingested."""
    (tmp_path / "a.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    (tmp_path / "b.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Bo: hi\n")
    is_file = Path.is_file

    def refused(self: Path) -> bool:
        if self.name == "b.md":
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", refused)
    report = ingest_paths(tx_factory, [tmp_path], "files")
    assert report.ingested == ["a"]
    assert [(Path(p).name, why) for p, why in report.errors] == [
        ("b.md", "cannot be read (Permission denied)")
    ]


def test_a_walked_named_pipe_or_broken_link_is_reported_not_skipped_in_silence(
    tx_factory, tmp_path: Path
) -> None:
    """A folder's page-named entry that is no regular file was left out without a word."""
    import os

    (tmp_path / "a.md").write_text("---\ntype: conversation\n---\n[2024-01-01 10:00] Ann: hi\n")
    os.mkfifo(tmp_path / "pipe.md")
    (tmp_path / "gone.md").symlink_to(tmp_path / "nowhere.md")
    # An editor's lock beside a page being edited (Emacs: a link to nowhere) is no page, and no error.
    (tmp_path / ".#a.md").symlink_to("user@host.1234:1700000000")
    report = ingest_paths(tx_factory, [tmp_path], "files")
    assert report.ingested == ["a"]
    assert sorted((Path(p).name, "not a regular file" in why) for p, why in report.errors) == [
        ("gone.md", True),
        ("pipe.md", True),
    ]


def test_each_created_job_is_sent_as_its_page_commits(tx_factory, tmp_path: Path) -> None:
    """Sent all at the end of a long ingest, every job went twice: the sweeper sends jobs left unsent
    for two seconds, and had sent them meanwhile."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.md").write_text(f"---\ntype: conversation\n---\n[2024-01-01 10:00] {name}: hi\n")
    heard: list[str] = []
    sends: list[tuple[int, list[tuple[int, str]]]] = []

    def send(created: list[tuple[int, str]]) -> int:
        sends.append((len(heard), created))
        return len(created)

    report = ingest_paths(tx_factory, [tmp_path], "sent", on_file=lambda p: heard.append(p.name), send=send)
    assert [(files_done, len(jobs)) for files_done, jobs in sends] == [(0, 1), (1, 1)]
    assert [job for _, jobs in sends for job in jobs] == report.created and report.enqueued == 2


def test_a_broker_that_is_away_is_tried_once_not_once_a_page(tx_factory, tmp_path: Path) -> None:
    """Each page's send waits on a broker that is down (Celery's publish retries): tried for every page
    of a large ingest, that was minutes to hours. The sweeper sends what is left."""
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.md").write_text(f"---\ntype: conversation\n---\n[2024-01-01 10:00] {name}: hi\n")
    tries: list[int] = []

    def away(created: list[tuple[int, str]]) -> int:
        tries.append(len(created))
        return 0

    report = ingest_paths(tx_factory, [tmp_path], "away", send=away)
    assert tries == [1] and report.enqueued == 0 and len(report.created) == 3


def test_a_newer_delivery_of_the_stored_content_wins_over_an_older_change_committed_meanwhile(
    factory,  # type: ignore[no-untyped-def]
) -> None:
    """D3 (signed last, the stored content C1) read the page unlocked and found it unchanged; D2 (signed
    earlier, content C2) committed before D3 dated the row; the dating, which did not look at the
    content, stamped D3's time on C2: the page kept the older content, and C1 was lost."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select

    from models import Page
    from worker.extraction.pages import PageIn, upsert_page

    t1 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    c1 = PageIn(source_id="default", slug="race/a", type="conversation", title="t", compiled_truth="one")
    c2 = PageIn(source_id="default", slug="race/a", type="conversation", title="t", compiled_truth="two")
    with factory.begin() as session:
        upsert_page(session, c1, t1)

    # D2 commits just before D3 dates the row.
    result = upserted_with_another_first(
        factory,
        (c1, t1 + timedelta(seconds=20)),
        (c2, t1 + timedelta(seconds=10)),
        "UPDATE pages SET delivered_at",
    )
    assert result.changed
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth).where(Page.slug == "race/a")).one() == "one"


def upserted_with_another_first(
    factory: sessionmaker[Session], this: tuple[Any, Any], other: tuple[Any, Any], before: str
) -> Any:
    """``upsert_page`` of ``this`` (page, delivered at), another delivery (``other``) committing just
    before this one's first statement that starts with ``before``."""
    from sqlalchemy import event

    from worker.extraction.pages import upsert_page

    raced: list[bool] = []
    with factory.begin() as session:
        connection = session.connection()

        def other_commits_first(conn, cursor, statement, *_):  # type: ignore[no-untyped-def]
            if statement.lstrip().startswith(before) and not raced:
                raced.append(True)
                with factory.begin() as second:
                    upsert_page(second, *other)

        event.listen(connection, "before_cursor_execute", other_commits_first)
        result = upsert_page(session, *this)
        event.remove(connection, "before_cursor_execute", other_commits_first)
    assert raced
    return result


def test_an_older_delivery_of_the_content_a_newer_one_stored_meanwhile_is_unchanged_not_stale(
    factory: sessionmaker[Session],
) -> None:
    """Two stores of one new page's same content at once, the later-dated committing first: the
    earlier one's upsert found the row dated later and raised StaleDeliveryError, and the CLI said a
    later delivery "stored this page; not replaced" (the webhook answered 409) over identical content."""
    from datetime import UTC, datetime, timedelta

    from worker.extraction.pages import PageIn

    t1 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    same = PageIn(source_id="default", slug="race/same", type="conversation", title="t", compiled_truth="one")
    result = upserted_with_another_first(
        factory, (same, t1), (same, t1 + timedelta(seconds=10)), "INSERT INTO pages"
    )
    assert not result.changed


def test_an_ingest_postgres_ends_to_break_a_deadlock_stores_its_page_all_the_same(
    tmp_path: Path, factory: sessionmaker[Session]
) -> None:
    """A file turning a page into one with nothing to extract drops its facts: the page, then their
    entities' checkpoints (sorted), locked. Another transaction holding one of those checkpoints and
    then wanting the page (here by hand; a delivery emptying pages of the same entities takes their
    checkpoints page by page, a crossed order) deadlocked with it; when the ingest was the one Postgres
    ended, the error stopped the whole run mid-folder."""
    from models import Fact, Page
    from tests.rows import fact_row
    from worker.consolidation.store import lock_checkpoint
    from worker.extraction.pages import PageIn, upsert_page

    with factory.begin() as session:
        page_id = upsert_page(
            session, PageIn(slug="notes/p", type="conversation", compiled_truth="x")
        ).page_id
        session.execute(
            Fact.__table__.insert(),
            [fact_row(0) | {"source_markdown_slug": "notes/p", "entity_slug": "people/alice"}],
        )
    (tmp_path / "p.md").write_text("---\nslug: notes/p\ntype: note\n---\nno longer a conversation\n")
    with factory() as other, ThreadPoolExecutor(1) as pool:
        lock_checkpoint(other, "default", "people/alice")  # the other side holds the entity first
        ingesting = pool.submit(ingest_paths, factory, [tmp_path])
        assert waits_on_a_lock(factory, ingesting), "the ingest never waited on the entity's checkpoint"
        other.execute(select(Page.id).where(Page.id == page_id).with_for_update())  # then the page
        other.commit()
        report = ingesting.result(timeout=60)
    assert report.errors == [] and report.ingested == ["notes/p"], report
    with factory() as session:
        assert session.scalar(select(Page.type).where(Page.id == page_id)) == "note"
