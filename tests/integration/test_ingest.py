"""Ingesting page files into the store (the path `factmill ingest` takes)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
