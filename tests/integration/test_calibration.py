"""Calibration against a real Postgres: observations, CSV import, recompute, activation, the API, the CLI,
and one recompute through a real Celery worker process."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient
from sqlalchemy import delete, event, func, insert, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from models import CalibrationObservation, CalibrationThreshold, Compaction, Job, Transcript
from tests.auth import send_key
from tests.clock import FakeClock
from tests.integration.test_api import Recorder, make_runtime
from tests.service import SessionBroker, running, service_env, start_worker, wait_for
from worker.api.app import create_app
from worker.calibration import (
    FALLBACK,
    METHOD,
    PAUSED_REASON,
    SUBJECT,
    ActiveThreshold,
    CsvFormatError,
    ObservationError,
    ObservationIn,
    StoredObservation,
    ThresholdCache,
    UnknownCompactionError,
    active_threshold,
    add_observation,
    add_observations,
    describe_tau,
    import_csv,
    recompute,
    request_recompute,
    threshold_history,
)
from worker.calibration.queries import observations_since_last_version
from worker.celery_app import create_app as create_celery_app
from worker.config_store import CALIBRATION_ENABLED, set_config
from worker.core.signing import sign
from worker.jobs import outbox as jobs
from worker.jobs.lifecycle import run_job
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

SECRET = "test-secret"
PARAMS: dict[str, Any] = {"alpha": 0.1, "target_recall": 0.9, "min_observations": 20}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def separated(kept: int = 30, lost: int = 30, origin: str = "test") -> list[ObservationIn]:
    """Kept cases at 0.6 to 1.0, lost ones at 0.0 to 0.45 with the top third pinned at 0.5."""
    good = [0.6 + 0.4 * i / max(1, kept - 1) for i in range(kept)]
    pinned = lost // 3
    bad = [0.45 * i / max(1, lost - pinned - 1) for i in range(lost - pinned)] + [0.5] * pinned
    return [ObservationIn(c, True, origin) for c in good] + [ObservationIn(c, False, origin) for c in bad]


def add(factory: sessionmaker[Session], items: list[ObservationIn], every: int = 10_000) -> Any:
    return add_observations(factory, items, recompute_every=every)


def count(factory: sessionmaker[Session], model: Any) -> int:
    with factory() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


# The compaction ids the tests below judge: observations may only name compactions that exist.
JUDGED = (3, 5, 9, 17)
# The coverage the gate measured for each (a label of a compaction carries it: queries.store_observations).
MEASURED = {3: 0.6, 5: 0.82, 9: 0.4, 17: 0.2}


def make_compactions(factory: sessionmaker[Session], ids: Iterable[int]) -> None:
    with factory.begin() as session:
        if session.get(Transcript, "judged") is None:
            session.add(Transcript(id="judged"))
            session.flush()
        session.add_all(
            Compaction(
                id=id_,
                transcript_id="judged",
                status="rejected",
                cut_seq=0,
                tokens_before=0,
                coverage=MEASURED.get(id_, 0.5),
            )
            for id_ in ids
        )


@pytest.fixture
def judged(tx_factory: sessionmaker[Session]) -> tuple[int, ...]:
    make_compactions(tx_factory, JUDGED)
    return JUDGED


# Truncation: the CLI opens its own engine from FACTMILL_DATABASE_URL.
@pytest.fixture
def committed_judged(factory: sessionmaker[Session]) -> tuple[int, ...]:
    """``judged`` with real commits, for the CLI (its own engine from FACTMILL_DATABASE_URL)."""
    make_compactions(factory, JUDGED)
    return JUDGED


def versions(factory: sessionmaker[Session]) -> list[CalibrationThreshold]:
    with factory() as session:
        return list(reversed(threshold_history(session, 100)))


def current(factory: sessionmaker[Session]) -> ActiveThreshold:
    with factory() as session:
        return active_threshold(session)


# ---------------------------------------------------------------------------
# Observations
# ---------------------------------------------------------------------------


def test_add_observations_stores_them(tx_factory: sessionmaker[Session], judged: tuple[int, ...]) -> None:
    report = add(
        tx_factory, [ObservationIn(0.6, True, "eval", compaction_id=3), ObservationIn(0.1, False, "eval")]
    )
    assert [s.duplicate for s in report.stored] == [False, False] and report.conflicts == []
    with tx_factory() as session:
        rows = session.scalars(select(CalibrationObservation).order_by(CalibrationObservation.id)).all()
        assert [(r.coverage, r.answer_kept, r.origin, r.compaction_id) for r in rows] == [
            (0.6, True, "eval", 3),
            (0.1, False, "eval", None),
        ]
        assert rows[0].dedupe_key is not None and rows[1].dedupe_key is None
        assert rows[0].created_at is not None


@pytest.mark.parametrize("coverage", [math.nan, 1.0000001, -0.5, math.inf])
def test_nan_and_out_of_range_coverage_is_refused_before_the_store(
    tx_factory: sessionmaker[Session], coverage: float
) -> None:
    with pytest.raises(ValueError, match="coverage must be a number from 0 to 1"):
        add_observation(tx_factory, ObservationIn(coverage, True, "x"), recompute_every=50)
    assert count(tx_factory, CalibrationObservation) == 0


def test_the_table_refuses_nan_and_out_of_range_too(tx_factory: sessionmaker[Session]) -> None:
    from sqlalchemy.exc import IntegrityError

    for value in (math.nan, 1.5):
        with (
            pytest.raises(IntegrityError, match="ck_calibration_observations_coverage"),
            tx_factory.begin() as s,
        ):
            s.add(CalibrationObservation(coverage=value, answer_kept=True, origin="raw"))


def test_duplicates_are_reported_not_stored_twice(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    keyed = ObservationIn(0.7, True, "eval", idempotency_key="k-1")
    judged = ObservationIn(0.4, False, "eval", compaction_id=9)
    first = add(tx_factory, [keyed, judged])
    again = add(tx_factory, [keyed, judged, ObservationIn(0.7, True, "eval", idempotency_key="k-1")])
    assert [s.duplicate for s in again.stored] == [True, True, True]
    assert [s.id for s in again.stored] == [first.stored[0].id, first.stored[1].id, first.stored[0].id]
    assert again.added == [] and again.recompute is None
    # Without a key or a compaction id, two equal labels are two real cases.
    add(tx_factory, [ObservationIn(0.5, True, "cli"), ObservationIn(0.5, True, "cli")])
    assert count(tx_factory, CalibrationObservation) == 4


def test_a_key_reused_for_a_different_observation_is_a_conflict(tx_factory: sessionmaker[Session]) -> None:
    add(tx_factory, [ObservationIn(0.7, True, "eval", idempotency_key="k-2")])
    report = add(
        tx_factory, [ObservationIn(0.2, False, "eval", idempotency_key="k-2"), ObservationIn(0.3, True, "e")]
    )
    assert [index for index, _ in report.conflicts] == [0]
    assert "idempotency_key 'k-2' was already used for a different observation" in report.conflicts[0][1]
    assert [s.index for s in report.added] == [1]  # the good one is still stored
    with pytest.raises(ObservationError, match="already used"):
        add_observation(
            tx_factory, ObservationIn(0.9, True, "eval", idempotency_key="k-2"), recompute_every=50
        )


def test_an_observation_of_a_compaction_that_does_not_exist_is_refused(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    report = add(
        tx_factory,
        [
            ObservationIn(0.6, True, "eval", compaction_id=999),
            ObservationIn(0.6, True, "eval", compaction_id=judged[0]),
            ObservationIn(0.2, False, "eval", idempotency_key="k-404", compaction_id=404),
        ],
    )
    assert report.conflicts == [
        (0, "compaction_id 999: no such compaction"),
        (2, "compaction_id 404: no such compaction"),
    ]
    assert [s.index for s in report.added] == [1]  # the rest of the batch is stored
    with tx_factory() as session:
        assert list(session.scalars(select(CalibrationObservation.compaction_id))) == [judged[0]]
    with pytest.raises(ObservationError, match="no such compaction"):
        add_observation(tx_factory, ObservationIn(0.6, True, "eval", compaction_id=999), recompute_every=50)


def test_a_label_of_a_compaction_never_judged_is_refused(tx_factory: sessionmaker[Session]) -> None:
    """A compaction that failed before a coverage was measured has no summary to judge: its label was
    stored with the client's number and fed the next threshold."""
    with tx_factory.begin() as session:
        session.add(Transcript(id="unjudged"))
        session.flush()
        failed = Compaction(transcript_id="unjudged", status="failed", cut_seq=0, tokens_before=0)
        session.add(failed)
        session.flush()
        failed_id = failed.id
    report = add(tx_factory, [ObservationIn(0.95, True, "eval", compaction_id=failed_id)])
    assert report.added == [] and report.conflicts == [
        (
            0,
            f"compaction_id {failed_id}: that compaction has no measured coverage (it failed, or its "
            "transcript gave the gate no query words to judge it on); only a judged compaction (one with a "
            "coverage) can be labelled",
        )
    ]
    with pytest.raises(UnknownCompactionError, match="has no measured coverage"):
        add_observation(
            tx_factory, ObservationIn(0.95, True, "eval", compaction_id=failed_id), recompute_every=50
        )
    # One stored before the rule: a sender's retry of it gets its duplicate answer, not a 409.
    earlier = ObservationIn(0.9, True, "eval", idempotency_key="before", compaction_id=failed_id)
    with tx_factory.begin() as session:
        row = {**earlier.recorded(), "dedupe_key": earlier.dedupe_key()}
        session.execute(insert(CalibrationObservation).values(**row))
    retried = add(tx_factory, [earlier])
    assert retried.conflicts == [] and [s.duplicate for s in retried.stored] == [True]


def test_a_batch_naming_more_compactions_than_a_query_has_parameters_is_checked(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """The ids were looked up in one IN list, a parameter each: past 65,535 the driver refused the
    query and the whole import failed as "cannot reach the database"."""
    unknown = [ObservationIn(0.5, True, "eval", compaction_id=10**9 + i) for i in range(70_000)]
    report = add(tx_factory, [ObservationIn(0.6, True, "eval", compaction_id=judged[0]), *unknown])
    assert len(report.conflicts) == 70_000 and report.conflicts[0] == (
        1,
        f"compaction_id {10**9}: no such compaction",
    )
    assert [s.index for s in report.added] == [0]


def test_a_recompute_reads_up_to_an_id_below_which_nothing_is_still_uncommitted(
    factory: sessionmaker[Session],
) -> None:
    """Ids are drawn at insert, not at commit: while an import of ids 1..60 was still open, a feedback
    took id 61 and committed, and a recompute recorded "up to 61" from that one row. Its version could
    not be derived again from its range, and the 60 never counted as new since any version."""
    import threading

    from worker.calibration.queries import store_observations

    importing = factory()
    importing.begin()
    store_observations(importing, separated())  # ids drawn, not committed
    add(factory, [ObservationIn(0.9, True, "feedback")])  # a later id, committed
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(recompute(factory, **PARAMS)))
    worker.start()
    worker.join(1.0)
    waited = worker.is_alive()
    # Meanwhile feedback is stored at once: a waiting exclusive lock request queued every later
    # storing transaction behind it, so all feedback waited for the import.
    feedback = threading.Thread(target=lambda: add(factory, [ObservationIn(0.8, True, "feedback")]))
    feedback.start()
    feedback.join(5)
    stored_at_once = not feedback.is_alive()
    importing.commit()
    importing.close()
    worker.join(30)
    feedback.join(30)
    assert waited, "the recompute read past an open import"
    assert stored_at_once, "feedback waited behind the recompute's lock request"
    [result] = results
    with factory() as session:
        row = session.get(CalibrationThreshold, result.version)
        newest = session.scalar(select(func.max(CalibrationObservation.id)))
    assert row is not None and (row.n, row.max_observation_id) == (62, newest)


def test_a_label_of_a_compaction_carries_the_coverage_it_was_measured_at(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """Any number was stored with a compaction's label (0.615, as `transcripts show` prints 0.6153...):
    τ was computed on coverages the gate never measured, and could pass the very case it should reject."""
    report = add(
        tx_factory,
        [
            ObservationIn(0.615, False, "eval", compaction_id=3),
            ObservationIn(MEASURED[3], False, "eval", compaction_id=3),
        ],
    )
    assert report.conflicts == [
        (
            0,
            f"compaction_id 3: its coverage was measured as {MEASURED[3]!r}, not 0.615; send the measured "
            "coverage (the transcript's context, or GET /v1/transcripts/{id}/compactions, gives it) or "
            "leave compaction_id out",
        )
    ]
    assert [s.index for s in report.added] == [1]
    with pytest.raises(UnknownCompactionError, match="measured as"):  # the API's 409
        add_observation(tx_factory, ObservationIn(0.9, True, "eval", compaction_id=5), recompute_every=50)
    # Within a last digit's rounding (a spreadsheet's 15 digits) it is stored as measured: stored as
    # sent, τ (the lost coverage plus ε) sat under the measured coverage, and the gate passed the case.
    near = MEASURED[9] * (1 - 4e-16)
    assert near != MEASURED[9]
    [stored] = add(tx_factory, [ObservationIn(near, False, "eval", compaction_id=9)]).added
    with tx_factory() as session:
        row = session.get(CalibrationObservation, stored.id)
        assert row is not None and row.coverage == MEASURED[9]
    # Resent after its transcript's erasure (its compaction gone), a keyed one is still its duplicate.
    keyed = ObservationIn(MEASURED[17] * (1 + 4e-16), True, "eval", compaction_id=17, idempotency_key="n-1")
    [first] = add(tx_factory, [keyed]).added
    with tx_factory.begin() as session:
        session.execute(delete(Compaction).where(Compaction.id == 17))
    again = add(tx_factory, [keyed])
    assert again.conflicts == [] and again.stored == [StoredObservation(0, first.id, True)]


def test_the_measured_coverage_a_label_carries_is_what_the_mcp_context_gives(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """An MCP agent saw the compaction's id but not its coverage, and its label was refused for a number
    it could not know (get_transcript_context gives it with the id now)."""
    from worker.compaction.views import measured_coverage

    with tx_factory() as session:
        assert measured_coverage(session, 3) == MEASURED[3] and measured_coverage(session, None) is None


def test_a_label_stored_before_labels_carried_the_measured_coverage_is_still_a_duplicate(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """A keyed retry (or a re-import) of a label stored at another coverage before the rule got a 409: it
    is the duplicate it always was. (The same key with the measured coverage is a key conflict: the key
    names the label stored; a new key stores the measured one beside it.)"""
    sent = ObservationIn(0.615, False, "eval", compaction_id=3, idempotency_key="old-1")
    with tx_factory.begin() as session:  # as stored before the rule
        session.add(
            CalibrationObservation(
                coverage=0.615,
                answer_kept=False,
                origin="eval",
                compaction_id=3,
                dedupe_key=sent.dedupe_key(),
            )
        )
    report = add(tx_factory, [sent])
    assert report.conflicts == [] and [s.duplicate for s in report.stored] == [True]


def test_deleting_a_compaction_keeps_its_observations_without_the_id(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    gone, kept = judged[0], judged[1]
    report = add(
        tx_factory,
        [
            ObservationIn(0.6, True, "eval", compaction_id=gone),
            ObservationIn(0.82, False, "eval", compaction_id=kept),
        ],
    )
    with tx_factory.begin() as session:
        session.execute(delete(Compaction).where(Compaction.id == gone))
    with tx_factory() as session:
        rows = {r.id: r for r in session.scalars(select(CalibrationObservation))}
    first, second = (rows[s.id] for s in report.stored)
    assert first.compaction_id is None and (first.coverage, first.answer_kept) == (0.6, True)
    assert second.compaction_id == kept


def test_a_resubmission_after_its_compaction_was_erased_is_a_duplicate(
    tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """An at-least-once sender's retry after the transcript's erasure got "no such compaction" (409):
    the key was never looked up, though the observation was stored."""
    gone = judged[0]
    sent = ObservationIn(0.6, True, "eval", compaction_id=gone, idempotency_key="k-erased")
    [first] = add(tx_factory, [sent]).stored
    with tx_factory.begin() as session:
        session.execute(delete(Compaction).where(Compaction.id == gone))
    new = ObservationIn(0.7, True, "eval", compaction_id=gone, idempotency_key="k2")
    again = add(tx_factory, [sent, new])
    assert again.stored == [StoredObservation(0, first.id, True)]
    assert [index for index, _ in again.conflicts] == [1]  # a new observation of it: no such compaction
    assert count(tx_factory, CalibrationObservation) == 1


def test_a_large_batch_in_chunks(tx_factory: sessionmaker[Session]) -> None:
    items = [ObservationIn(i / 2500, i % 3 != 0, "bulk", idempotency_key=f"b{i}") for i in range(2500)]
    report = add(tx_factory, items)
    assert len(report.added) == 2500 and [s.index for s in report.stored] == list(range(2500))
    assert count(tx_factory, CalibrationObservation) == 2500
    assert len(add(tx_factory, items[2000:]).duplicates) == 500


def test_every_n_observations_request_one_pending_recompute(tx_factory: sessionmaker[Session]) -> None:
    assert add(tx_factory, separated(2, 2), every=5).recompute is None  # 4 so far
    fifth = add(tx_factory, [ObservationIn(0.5, True, "t")], every=5)
    assert fifth.recompute is not None and fifth.recompute.created
    assert fifth.pending_jobs() == [(fifth.recompute.job_id, "calibration")]
    sixth = add(tx_factory, [ObservationIn(0.5, True, "t")], every=5)
    assert sixth.recompute is not None and sixth.recompute.job_id == fifth.recompute.job_id
    assert not sixth.recompute.created and sixth.pending_jobs() == []
    with tx_factory() as session:
        job = session.get(Job, fifth.recompute.job_id)
        assert job is not None
        assert (job.kind, job.subject, job.status, job.options) == (
            "calibration",
            SUBJECT,
            "queued",
            {"trigger": "observations"},
        )
    # A version computed from these resets the count.
    recompute(tx_factory, **PARAMS)
    assert add(tx_factory, [ObservationIn(0.5, True, "t")], every=5).recompute is None


def test_the_count_since_the_last_version_stops_where_it_is_asked_to(
    tx_factory: sessionmaker[Session],
) -> None:
    # Every feedback asks whether a recompute is due; while versions lag, a full count would grow
    # with every observation, so it counts only as far as the question needs.
    add(tx_factory, separated(5, 5), every=1000)
    with tx_factory() as session:
        assert observations_since_last_version(session, 3) == 3
        assert observations_since_last_version(session, 1000) == 10
    recompute(tx_factory, **PARAMS)
    add(tx_factory, [ObservationIn(0.5, True, "t")] * 2, every=1000)
    with tx_factory() as session:
        assert observations_since_last_version(session, 1000) == 2


# ---------------------------------------------------------------------------
# CSV import
# ---------------------------------------------------------------------------

CSV = """coverage,answer_kept,origin,compaction_id
0.9,true,eval
nan,true,eval
0.2,lost,,17

1.5,false,eval
# reviewed by hand
0.6,maybe,eval
0.7,kept,eval
"""


def test_import_keeps_good_rows_and_reports_bad_ones_by_line(
    tx_factory: sessionmaker[Session], tmp_path: Path, judged: tuple[int, ...]
) -> None:
    path = tmp_path / "labels.csv"
    path.write_text(CSV, encoding="utf-8")
    report = import_csv(tx_factory, path, recompute_every=50)
    assert report.rows == 6
    assert [line for line, _ in report.added] == [2, 4, 9]
    assert [line for line, _ in report.errors] == [3, 6, 8]
    assert "nan" in dict(report.errors)[3] and "got 1.5" in dict(report.errors)[6]
    with tx_factory() as session:
        origins = session.scalars(select(CalibrationObservation.origin).order_by(CalibrationObservation.id))
        assert list(origins) == ["eval", "csv:labels.csv", "eval"]
    again = import_csv(tx_factory, path, recompute_every=50)
    assert again.added == [] and [line for line, _ in again.duplicates] == [2, 4, 9]
    assert count(tx_factory, CalibrationObservation) == 3
    # The same bytes under another name, or with --origin for the blanks: the same rows. The judged
    # compaction's row (blank origin) was stored again under the new default origin, counted twice in
    # every recompute; the others were refused as "already used for a different observation".
    copy = tmp_path / "copy.csv"
    copy.write_text(CSV, encoding="utf-8")
    for report in (
        import_csv(tx_factory, copy, recompute_every=50),
        import_csv(tx_factory, path, origin="x", recompute_every=50),
    ):
        assert report.added == [] and [line for line, _ in report.duplicates] == [2, 4, 9]
        assert [line for line, _ in report.errors] == [3, 6, 8]
    assert count(tx_factory, CalibrationObservation) == 3


def test_a_file_saved_again_with_a_bom_and_crlf_lines_is_the_same_file(
    tx_factory: sessionmaker[Session], tmp_path: Path, judged: tuple[int, ...]
) -> None:
    """A spreadsheet saving the file again (a byte-order mark, CRLF line ends, no last newline) changed
    its bytes and so every row's key: every row was stored a second time."""
    path = tmp_path / "labels.csv"
    path.write_text(CSV, encoding="utf-8")
    first = import_csv(tx_factory, path, recompute_every=50)
    path.write_bytes(b"\xef\xbb\xbf" + CSV.rstrip("\n").replace("\n", "\r\n").encode())
    again = import_csv(tx_factory, path, recompute_every=50)
    assert again.added == [] and again.duplicates == first.added
    assert count(tx_factory, CalibrationObservation) == len(first.added)


def test_a_file_imported_before_under_its_bytes_digest_is_the_same_file(
    tx_factory: sessionmaker[Session],
    tmp_path: Path,
    judged: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows without a key were known by the digest of the file's bytes until 2026-12: a spreadsheet's file
    (a byte-order mark, CRLF) imported then was a new file to the text's digest, every such row stored
    again."""
    import hashlib

    from worker.calibration import service

    path = tmp_path / "labels.csv"
    path.write_bytes(b"\xef\xbb\xbf" + CSV.replace("\n", "\r\n").encode())
    with monkeypatch.context() as old_release:  # the release before: the bytes' digest
        old_release.setattr(
            service, "content_digest", lambda _: hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        )
        first = import_csv(tx_factory, path, recompute_every=50)
    again = import_csv(tx_factory, path, recompute_every=50)
    assert again.added == [] and again.duplicates == first.added
    assert count(tx_factory, CalibrationObservation) == len(first.added)


def test_import_reports_its_progress_a_statement_at_a_time(
    tx_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """A 64 MiB file is minutes of inserts: the CLI's bar hears of each statement's rows."""
    path = tmp_path / "many.csv"
    path.write_text("".join(f"0.{n % 10},{'true' if n % 3 else 'false'},eval\n" for n in range(2500)))
    heard: list[tuple[int, int]] = []
    report = import_csv(tx_factory, path, recompute_every=50, progress=lambda *step: heard.append(step))
    assert len(report.added) == 2500
    assert heard == [(1000, 2500), (2000, 2500), (2500, 2500)]


def test_import_reports_a_row_naming_an_unknown_compaction(
    tx_factory: sessionmaker[Session], tmp_path: Path, judged: tuple[int, ...]
) -> None:
    path = tmp_path / "judged.csv"
    past_bigint = 2**63  # the import's lookup of it failed with "bigint out of range" (a traceback)
    path.write_text(
        f"0.5,true,eval,404\n0.6,true,eval,{judged[0]}\n0.7,true,eval,{past_bigint}\n", encoding="utf-8"
    )
    report = import_csv(tx_factory, path, recompute_every=50)
    assert report.errors == [
        (1, "compaction_id 404: no such compaction"),
        (3, f"compaction_id must be a positive integer up to {2**63 - 1}, got {past_bigint}"),
    ]
    assert [line for line, _ in report.added] == [2]


def test_import_refuses_an_unreadable_file(tx_factory: sessionmaker[Session], tmp_path: Path) -> None:
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"0.5,true,\xff\xfe\n")
    with pytest.raises(CsvFormatError, match="not UTF-8"):
        import_csv(tx_factory, binary, recompute_every=50)
    header = tmp_path / "header.csv"
    header.write_text("coverage,kept\n0.5,true\n")
    with pytest.raises(CsvFormatError, match="unknown column"):
        import_csv(tx_factory, header, recompute_every=50)
    # Read no further than the cap: a file past it, or one that never ends, is refused, not loaded.
    huge = tmp_path / "huge.csv"
    with huge.open("wb") as file:  # sparse: 1 GiB that takes no disk
        file.truncate(1 << 30)
    for endless in (huge, Path("/dev/zero")):
        with pytest.raises(CsvFormatError, match="import it in parts"):
            import_csv(tx_factory, endless, recompute_every=50)
    assert count(tx_factory, CalibrationObservation) == 0


def test_import_with_a_bom_and_crlf(tx_factory: sessionmaker[Session], tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffcoverage,answer_kept\r\n0.5,TRUE\r\n0.25,False\r\n".encode())
    report = import_csv(tx_factory, path, recompute_every=50)
    assert [line for line, _ in report.added] == [2, 3] and report.errors == []


# ---------------------------------------------------------------------------
# Recompute
# ---------------------------------------------------------------------------


def test_a_compaction_labelled_by_several_judges_counts_once(tx_factory: sessionmaker[Session]) -> None:
    """Each label was a case of its own: copies of one compaction fell in both halves, and five
    compactions labelled by four judges passed the 20-observation minimum and activated a version."""
    measured = {201: 0.80, 202: 0.81, 203: 0.82, 204: 0.30, 205: 0.35}
    with tx_factory.begin() as session:
        session.add(Transcript(id="panel"))
        session.flush()
        session.add_all(
            Compaction(
                id=id_, transcript_id="panel", status="rejected", cut_seq=0, tokens_before=0, coverage=c
            )
            for id_, c in measured.items()
        )
    judges = [
        ObservationIn(coverage, coverage > 0.5, f"judge-{judge}", compaction_id=id_)
        for judge in range(4)
        for id_, coverage in measured.items()
    ]
    assert len(add(tx_factory, judges).added) == 20
    result = recompute(tx_factory, **PARAMS)
    assert result.outcome != "activated" and current(tx_factory) == FALLBACK
    assert "too few observations: 5 (3 kept, 2 lost)" in result.reason, result.reason
    # Counted as Postgres counts them (cases, not rows): nothing new, nothing written (counted as rows,
    # every hourly recompute loaded every observation and wrote a version).
    assert recompute(tx_factory, **PARAMS).outcome == "unchanged"
    # A version an earlier release activated on those 20 labels as 20 cases is retired (kept active, the
    # gates went on with a τ five cases stand behind, until new feedback earned another).
    with tx_factory.begin() as session:
        session.add(
            CalibrationThreshold(
                tau=0.35, alpha=0.1, target_recall=0.9, min_observations=20, n=20, n_bad=8,
                max_observation_id=max(o.id for o in session.query(CalibrationObservation)),
                split_method=METHOD, active=True, reason="counted apart", trigger="manual",
            )
        )  # fmt: skip
    assert current(tx_factory).tau == 0.35
    again = recompute(tx_factory, **PARAMS)
    assert "counted the labels of one compaction as several cases and is retired" in again.reason, (
        again.reason
    )
    assert current(tx_factory) == FALLBACK


def test_recompute_activates_a_threshold_earned_on_held_out_data(tx_factory: sessionmaker[Session]) -> None:
    report = add(tx_factory, separated())
    result = recompute(tx_factory, trigger="manual", **PARAMS)
    assert result.outcome == "activated", result.reason
    assert result.tau is not None and 0.5 < result.tau < 0.6
    assert result.active == ActiveThreshold(result.tau, result.version)
    assert current(tx_factory) == result.active
    [row] = versions(tx_factory)
    assert row.active and row.activated_at is not None and row.tau == result.tau
    assert (row.n, row.n_bad, row.held_out_n, row.held_out_rate) == (60, 30, 30, 1.0)
    assert (row.alpha, row.target_recall, row.min_observations) == (0.1, 0.9, 20)
    assert row.max_observation_id == max(s.id for s in report.added)  # ids go on across tests
    assert row.split_method == "stratified-sha256-alternate-v1; activates on >= 5 accepted held-out cases"
    assert row.trigger == "manual" and "meets the target" in row.reason
    assert "no version is active" not in row.reason


def test_recompute_refuses_a_threshold_the_held_out_half_does_not_support(
    tx_factory: sessionmaker[Session],
) -> None:
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    assert first.activated and first.tau is not None
    # Now many answers are lost at full coverage: no τ can separate them.
    add(tx_factory, [ObservationIn(1.0, False, "drift") for _ in range(40)])
    second = recompute(tx_factory, **PARAMS)
    assert second.outcome == "kept" and not second.activated
    assert second.held_out_rate is not None and second.held_out_rate < 0.9
    assert f"version {first.version} (τ={describe_tau(first.tau)}) stays active" in second.reason
    assert second.active == first.active and current(tx_factory) == first.active
    old, new = versions(tx_factory)
    assert old.active and not new.active and new.activated_at is None and new.tau == 1.0


def test_a_later_good_version_replaces_the_active_one(tx_factory: sessionmaker[Session]) -> None:
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    add(tx_factory, separated(origin="more"))
    second = recompute(tx_factory, **PARAMS)
    assert second.activated and f"replaces version {first.version}" in second.reason
    assert [v.active for v in versions(tx_factory)] == [False, True]
    assert current(tx_factory).version == second.version


@pytest.mark.parametrize(
    ("items", "reason"),
    [
        ([], "no observations yet"),
        (
            [ObservationIn(0.9, True, "t")] * 5 + [ObservationIn(0.1, False, "t")] * 5,
            "too few observations: 10",
        ),
        ([ObservationIn(0.9, True, "t")] * 30, "no observation lost the answer"),
        ([ObservationIn(0.1, False, "t")] * 30, "every observation lost the answer"),
    ],
    ids=["empty", "too-few", "only-good", "only-bad"],
)
def test_data_that_cannot_support_a_threshold_is_recorded_not_activated(
    tx_factory: sessionmaker[Session], items: list[ObservationIn], reason: str
) -> None:
    add(tx_factory, items)
    result = recompute(tx_factory, **PARAMS)
    assert result.outcome == "kept" and result.tau is None
    assert reason in result.reason and "gates keep the fallback τ=0.5" in result.reason
    assert result.active == FALLBACK and current(tx_factory) == FALLBACK
    [row] = versions(tx_factory)
    assert not row.active and row.tau is None and row.n == len(items)


# The statement that loads every observation (worker.calibration.queries.load_observations).
LOAD_OBSERVATIONS = "coverage, answer_kept, compaction_id FROM calibration_observations"


def test_nothing_new_is_found_out_without_loading_the_observations(tx_factory: sessionmaker[Session]) -> None:
    """The hourly schedule's recompute read every observation ever stored into Python, then found it
    had nothing new: now Postgres counts them first, and only a recompute with something new loads."""
    add(tx_factory, separated())
    recompute(tx_factory, **PARAMS)
    engine = tx_factory.kw["bind"]
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        assert recompute(tx_factory, **PARAMS).outcome == "unchanged"
        loaded = [s for s in statements if LOAD_OBSERVATIONS in s]
        assert not loaded, loaded
        add(tx_factory, separated()[:3])
        assert recompute(tx_factory, **PARAMS).outcome in ("activated", "kept")
        assert [s for s in statements if LOAD_OBSERVATIONS in s]
    finally:
        event.remove(engine, "before_cursor_execute", seen)


def test_nothing_new_writes_nothing_unless_forced(tx_factory: sessionmaker[Session]) -> None:
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    again = recompute(tx_factory, **PARAMS)
    assert again.outcome == "unchanged" and again.version == first.version
    assert again.active == first.active
    assert len(versions(tx_factory)) == 1
    other_alpha = recompute(tx_factory, **(PARAMS | {"alpha": 0.2}))
    assert other_alpha.version == first.version + 1
    forced = recompute(tx_factory, force=True, **(PARAMS | {"alpha": 0.2}))
    assert forced.version == first.version + 2


def test_an_active_tau_of_one_an_earlier_release_activated_is_retired_at_the_next_recompute(
    tx_factory: sessionmaker[Session],
) -> None:
    """Only a lost case at full coverage puts τ at 1.0, and no version activates so now; one an earlier
    release activated reverted every summary short of full coverage, and "unchanged" kept it."""
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    with tx_factory.begin() as session:  # as the earlier rule left it: τ = 1.0, active
        session.execute(update(CalibrationThreshold).values(tau=1.0))
    assert current(tx_factory).tau == 1.0
    again = recompute(tx_factory, **PARAMS)  # the τ=1 version's own inputs: it was "unchanged"
    assert again.outcome == "activated" and 0 < current(tx_factory).tau < 1.0, again
    with tx_factory.begin() as session:
        session.execute(update(CalibrationThreshold).where(CalibrationThreshold.active).values(tau=1.0))
    kept = recompute(tx_factory, **(PARAMS | {"min_observations": 1000}))  # and not earned again
    assert kept.outcome == "kept" and current(tx_factory) == FALLBACK, kept
    assert f"version {first.version + 1} (τ=1) accepts only full coverage and is retired" in kept.reason


def test_a_version_made_under_other_rules_is_recomputed_and_retired_unless_earned_again(
    tx_factory: sessionmaker[Session],
) -> None:
    """ "Unchanged" compared observations and parameters only: after a release that changed the split or
    the activation rule, a version earned under the old ones stayed active until new feedback came,
    and for good when the new rules do not earn it."""
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    old_rules = "stratified-sha256-alternate-v1"
    with tx_factory.begin() as session:  # as a version written by the release before
        session.execute(update(CalibrationThreshold).values(split_method=old_rules))
    again = recompute(tx_factory, **PARAMS)
    assert (again.outcome, again.version) == ("activated", first.version + 1)  # earned again: replaces it
    assert recompute(tx_factory, **PARAMS).outcome == "unchanged"
    # Not earned under these rules (more observations than it asks for at 1,000): retired, the fallback.
    with tx_factory.begin() as session:
        session.execute(update(CalibrationThreshold).values(split_method=old_rules))
    kept = recompute(tx_factory, **(PARAMS | {"min_observations": 1000}))
    assert kept.outcome == "kept" and kept.active == FALLBACK and current(tx_factory) == FALLBACK
    assert "was made under other rules and is retired" in kept.reason
    # An old-rules version still active beside a latest one made under these (kept, as a release
    # between wrote it): "unchanged" no longer stands in the way of retiring it.
    with tx_factory.begin() as session:
        session.execute(
            update(CalibrationThreshold)
            .where(CalibrationThreshold.version == first.version)
            .values(active=True, split_method=old_rules)
        )
    again_kept = recompute(tx_factory, **(PARAMS | {"min_observations": 1000}))
    assert again_kept.outcome == "kept" and current(tx_factory) == FALLBACK


def test_recompute_rejects_bad_parameters(tx_factory: sessionmaker[Session]) -> None:
    with pytest.raises(ValueError, match="alpha must be strictly between 0 and 1"):
        recompute(tx_factory, **(PARAMS | {"alpha": 1.5}))
    assert versions(tx_factory) == []


# Truncation: six threads recompute at once (advisory lock across connections).
def test_concurrent_recomputes_leave_one_active_version(factory: sessionmaker[Session]) -> None:
    add(factory, separated())
    errors: list[BaseException] = []

    def run() -> None:
        try:
            recompute(factory, force=True, **PARAMS)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    rows = versions(factory)
    assert len(rows) == 6 and sum(r.active for r in rows) == 1 and rows[-1].active


def test_the_table_allows_one_active_version_only(tx_factory: sessionmaker[Session]) -> None:
    from sqlalchemy.exc import IntegrityError

    def version(active: bool) -> CalibrationThreshold:
        return CalibrationThreshold(
            tau=0.5, alpha=0.1, target_recall=0.9, min_observations=20, n=0, n_bad=0,
            split_method="x", active=active, reason="test", trigger="test",
        )  # fmt: skip

    with tx_factory.begin() as session:
        session.add_all([version(True), version(False), version(False)])
    with (
        pytest.raises(IntegrityError, match="uq_calibration_thresholds_active"),
        tx_factory.begin() as session,
    ):
        session.add(version(True))


# ---------------------------------------------------------------------------
# Reading the active threshold
# ---------------------------------------------------------------------------


class CountingFactory:
    """A session factory that counts sessions and can be made to fail."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self.calls = 0
        self.broken = False

    def __call__(self) -> Session:
        self.calls += 1
        if self.broken:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        return self.factory()


def test_active_threshold_falls_back_to_the_shipped_constant(tx_factory: sessionmaker[Session]) -> None:
    assert current(tx_factory) == ActiveThreshold(0.5, None)


def test_threshold_cache_serves_within_ttl_and_refreshes_after(tx_factory: sessionmaker[Session]) -> None:
    clock = FakeClock()
    counting = CountingFactory(tx_factory)
    cache = ThresholdCache(counting, ttl=30, clock=clock)  # type: ignore[arg-type]
    assert cache.get() == FALLBACK and counting.calls == 1
    add(tx_factory, separated())
    result = recompute(tx_factory, **PARAMS)
    clock.now += 29
    assert cache.get() == FALLBACK and counting.calls == 1  # still cached
    clock.now += 2
    assert cache.get() == result.active and counting.calls == 2
    assert cache.tau() == result.tau
    cache.invalidate()
    assert cache.get() == result.active and counting.calls == 3


def test_threshold_cache_serves_the_last_value_when_the_store_fails(
    tx_factory: sessionmaker[Session],
) -> None:
    clock = FakeClock()
    counting = CountingFactory(tx_factory)
    cache = ThresholdCache(counting, ttl=5, clock=clock)  # type: ignore[arg-type]
    counting.broken = True
    with pytest.raises(OperationalError):
        cache.get()  # nothing known yet: no invented threshold
    counting.broken = False
    known = cache.get()
    counting.broken = True
    clock.now += 10
    assert cache.get() == known


# Truncation: sixteen threads share the factory.
def test_threshold_cache_is_thread_safe_and_queries_once_per_ttl(factory: sessionmaker[Session]) -> None:
    add(factory, separated())
    expected = recompute(factory, **PARAMS).active
    counting = CountingFactory(factory)
    cache = ThresholdCache(counting, ttl=60)  # type: ignore[arg-type]
    seen: list[ActiveThreshold] = []
    barrier = threading.Barrier(16)

    def gate() -> None:
        barrier.wait()
        for _ in range(200):
            seen.append(cache.get())

    threads = [threading.Thread(target=gate) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counting.calls == 1 and len(seen) == 3200 and set(seen) == {expected}


# ---------------------------------------------------------------------------
# The job: kill switch, provenance on the job
# ---------------------------------------------------------------------------


def runtime(database_url: str, factory: sessionmaker[Session], **settings: Any) -> Runtime:
    from worker.config_store import ConfigReader

    values: dict[str, Any] = {"database_url": database_url, "calibration_min_observations": 20} | settings
    return Runtime(settings=Settings(**values), factory=factory, config=ConfigReader(factory, ttl=0))


def test_the_job_records_its_version_and_counters(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    add(tx_factory, separated())
    rt = runtime(database_url, tx_factory)
    request = request_recompute(tx_factory, "manual", sender=Recorder(tx_factory))
    outcome = run_job(rt, request.job_id, jobs.CALIBRATION)
    assert outcome.status == "succeeded"
    with tx_factory() as session:
        job = session.get(Job, request.job_id)
        assert job is not None and job.status == "succeeded" and job.finished_at is not None
        assert job.counters["outcome"] == "activated" and job.counters["held_out_rate"] == 1.0
        row = session.scalars(select(CalibrationThreshold)).one()
        assert (row.job_id, row.trigger, row.active) == (request.job_id, "manual", True)
    assert run_job(rt, request.job_id, jobs.CALIBRATION).status == "skipped"  # a redelivered message


def test_kill_switch_pauses_the_job_and_turning_it_on_resumes_it(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    add(tx_factory, separated())
    rt = runtime(database_url, tx_factory)
    with tx_factory.begin() as session:
        set_config(session, CALIBRATION_ENABLED, "false", updated_by="test")
    recorder = Recorder(tx_factory)
    request = request_recompute(tx_factory, "schedule", sender=recorder)
    assert recorder.calls == [("tasks.calibration.recompute", request.job_id, "calibration")]
    assert run_job(rt, request.job_id, jobs.CALIBRATION).status == "paused"
    with tx_factory() as session:
        job = session.get(Job, request.job_id)
        assert job is not None and (job.status, job.last_error) == ("paused", PAUSED_REASON)
    assert versions(tx_factory) == [] and current(tx_factory) == FALLBACK
    # One pending recompute at a time: the paused one is reused, not duplicated.
    assert request_recompute(tx_factory, "schedule", sender=recorder).job_id == request.job_id
    with tx_factory.begin() as session:
        set_config(session, CALIBRATION_ENABLED, "true", updated_by="test")
    assert jobs.apply_switch_change(tx_factory, CALIBRATION_ENABLED, "true", recorder) == 1
    assert recorder.calls[-1] == ("tasks.calibration.recompute", request.job_id, "calibration")
    assert run_job(rt, request.job_id, jobs.CALIBRATION).status == "succeeded"
    [only] = versions(tx_factory)  # the first version, whatever id the sequence gave it
    assert current(tx_factory).version == only.version


def test_a_switch_turned_off_while_the_recompute_ran_activates_nothing(
    database_url: str, tx_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch was read at the claim only: a recompute that waited for its lock behind a long one
    wrote and activated a new τ after the operator had turned calibration off."""
    from worker.calibration import service

    add(tx_factory, separated())
    evaluate = service.evaluate

    def switched_off_meanwhile(*args: Any, **kwargs: Any) -> Any:
        with tx_factory.begin() as session:
            set_config(session, CALIBRATION_ENABLED, "false", updated_by="test")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(service, "evaluate", switched_off_meanwhile)
    request = request_recompute(tx_factory, "schedule", sender=Recorder(tx_factory))
    assert run_job(runtime(database_url, tx_factory), request.job_id, jobs.CALIBRATION).status == "paused"
    assert versions(tx_factory) == [] and current(tx_factory) == FALLBACK


def test_a_job_of_another_kind_fails(database_url: str, tx_factory: sessionmaker[Session]) -> None:
    with tx_factory.begin() as session:
        job_id = jobs.request_job(session, jobs.EXTRACTION, "default|x").job_id
    assert run_job(runtime(database_url, tx_factory), job_id, jobs.CALIBRATION).status == "failed"


def test_bad_settings_fail_the_job_with_the_reason(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    rt = runtime(database_url, tx_factory)
    object.__setattr__(rt.settings, "calibration_alpha", 2.0)  # bypass validation: a corrupted setting
    request = request_recompute(tx_factory, "manual", sender=Recorder(tx_factory))
    assert run_job(rt, request.job_id, jobs.CALIBRATION).status == "failed"
    with tx_factory() as session:
        job = session.get(Job, request.job_id)
        assert job is not None and "alpha must be strictly between 0 and 1" in (job.last_error or "")


# ---------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------


@pytest.fixture
def recorder(tx_factory: sessionmaker[Session]) -> Recorder:
    return Recorder(tx_factory)


@pytest.fixture
def client(database_url: str, tx_factory: sessionmaker[Session], recorder: Recorder) -> Iterator[TestClient]:
    rt = make_runtime(database_url, tx_factory, calibration_recompute_every=3)
    with TestClient(create_app(rt, sender=recorder)) as test_client:
        send_key(test_client, tx_factory)
        yield test_client


# For asserting the job row was committed before the hand-off: real commits over the truncating `factory`
# (inside a rolled-back outer transaction no other connection ever sees the row).
@pytest.fixture
def committed_recorder(factory: sessionmaker[Session]) -> Recorder:
    return Recorder(factory)


@pytest.fixture
def committed_client(
    database_url: str, factory: sessionmaker[Session], committed_recorder: Recorder
) -> Iterator[TestClient]:
    rt = make_runtime(database_url, factory, calibration_recompute_every=3)
    with TestClient(create_app(rt, sender=committed_recorder)) as test_client:
        send_key(test_client, factory)
        yield test_client


def post_feedback(
    client: TestClient,
    payload: Any = None,
    *,
    raw: bytes | None = None,
    signed: bool = True,
    secret: str = SECRET,
    headers: dict[str, str] | None = None,
) -> Any:
    body = raw if raw is not None else json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if signed:
        key = all_headers.get("Idempotency-Key")
        all_headers["Factmill-Signature"] = sign(
            body, secret, method="POST", path="/v1/feedback", idempotency_key=key
        )
    return client.post("/v1/feedback", content=body, headers=all_headers)


FEEDBACK = {"coverage": 0.82, "answer_kept": True, "origin": "eval:nightly", "compaction_id": 5}


def test_signed_feedback_is_stored(
    client: TestClient,
    tx_factory: sessionmaker[Session],
    judged: tuple[int, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO"):
        response = post_feedback(client, FEEDBACK)
    assert response.status_code == 201, response.text
    assert "feedback stored as observation" in caplog.text
    assert "eval:nightly" not in caplog.text  # a client's own label (it may name a person): not logged
    body = response.json()
    assert body == {
        "id": body["id"],
        "duplicate": False,
        "coverage": 0.82,
        "answer_kept": True,
        "origin": "eval:nightly",
        "compaction_id": 5,
        "recompute_job_id": None,
    }
    with tx_factory() as session:
        row = session.get(CalibrationObservation, body["id"])
        assert row is not None and (row.coverage, row.answer_kept, row.compaction_id) == (0.82, True, 5)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"signed": False}, "missing Factmill-Signature"),
        ({"secret": "wrong"}, "does not match"),
        ({"headers": {"Factmill-Signature": "v1=abc"}, "signed": False}, "malformed"),
    ],
)
def test_unsigned_feedback_is_401(
    client: TestClient, tx_factory: sessionmaker[Session], kwargs: dict[str, Any], reason: str
) -> None:
    response = post_feedback(client, FEEDBACK, **kwargs)
    assert response.status_code == 401 and reason in response.json()["detail"]
    assert count(tx_factory, CalibrationObservation) == 0


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (FEEDBACK | {"coverage": 1.5}, "coverage: Input should be less than or equal to 1"),
        (FEEDBACK | {"coverage": -0.1}, "coverage: Input should be greater than or equal to 0"),
        (FEEDBACK | {"coverage": True}, "coverage: Input should be a valid number"),
        (FEEDBACK | {"coverage": "0.5"}, "coverage: Input should be a valid number"),
        (FEEDBACK | {"answer_kept": "yes"}, "answer_kept: Input should be a valid boolean"),
        ({"coverage": 0.5, "answer_kept": True}, "origin: Field required"),
        (FEEDBACK | {"origin": ""}, "origin must be 1 to 200 printable characters"),
        (FEEDBACK | {"compaction_id": 0}, "compaction_id: Input should be greater than or equal to 1"),
        (FEEDBACK | {"colour": "blue"}, "colour: Extra inputs are not permitted"),
        ([FEEDBACK], "body must be a JSON object"),
    ],
)
def test_invalid_feedback_is_422(
    client: TestClient, tx_factory: sessionmaker[Session], payload: Any, expected: str
) -> None:
    response = post_feedback(client, payload)
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"]
    assert count(tx_factory, CalibrationObservation) == 0


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinite_coverage_is_422(
    client: TestClient, tx_factory: sessionmaker[Session], literal: bytes
) -> None:
    raw = b'{"coverage": ' + literal + b', "answer_kept": false, "origin": "x"}'
    response = post_feedback(client, raw=raw)
    assert (
        response.status_code == 422
        and "coverage: Input should be a finite number" in response.json()["detail"]
    )
    assert count(tx_factory, CalibrationObservation) == 0


def test_malformed_and_oversized_feedback(client: TestClient) -> None:
    assert "not valid JSON" in post_feedback(client, raw=b'{"coverage": ').json()["detail"]
    big = json.dumps(FEEDBACK | {"origin": "x" * 70_000}).encode()
    response = post_feedback(client, raw=big)
    assert response.status_code == 413 and "65536-byte limit" in response.json()["detail"]


def test_feedback_answers_the_coverage_as_stored(
    client: TestClient, tx_factory: sessionmaker[Session], judged: tuple[int, ...]
) -> None:
    """A label within a last digit of its compaction's measured coverage is stored as measured: the
    answer said the number sent, not the one stored."""
    near = MEASURED[5] * (1 + 4e-16)
    assert near != MEASURED[5]
    response = post_feedback(client, FEEDBACK | {"coverage": near})
    assert response.status_code == 201, response.text
    assert response.json()["coverage"] == MEASURED[5]
    again = post_feedback(client, FEEDBACK | {"coverage": near})
    assert again.status_code == 200 and again.json()["coverage"] == MEASURED[5]


def test_duplicate_feedback_is_200_and_stored_once(
    client: TestClient, tx_factory: sessionmaker[Session], recorder: Recorder, judged: tuple[int, ...]
) -> None:
    keyed = {"coverage": 0.3, "answer_kept": False, "origin": "ui", "idempotency_key": "fb-1"}
    first = post_feedback(client, keyed)
    again = post_feedback(client, keyed)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["duplicate"] is True and again.json()["id"] == first.json()["id"]
    # The key may come as the Idempotency-Key header instead.
    unkeyed = {k: v for k, v in keyed.items() if k != "idempotency_key"}
    header = post_feedback(client, unkeyed, headers={"Idempotency-Key": "fb-1"})
    assert header.status_code == 200 and header.json()["duplicate"] is True
    # A judgement of a known compaction is its own key.
    assert post_feedback(client, FEEDBACK).status_code == 201
    assert post_feedback(client, FEEDBACK).json()["duplicate"] is True
    assert count(tx_factory, CalibrationObservation) == 2
    assert recorder.calls == []  # two observations: no recompute due yet (every 3)


def test_feedback_on_a_compaction_that_does_not_exist_is_409(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    response = post_feedback(client, FEEDBACK)  # no compaction 5 in this test's database
    assert response.status_code == 409 and response.json()["detail"] == "compaction_id 5: no such compaction"
    assert count(tx_factory, CalibrationObservation) == 0


def test_feedback_key_conflicts_are_422(client: TestClient, tx_factory: sessionmaker[Session]) -> None:
    keyed = {"coverage": 0.3, "answer_kept": False, "origin": "reviewer:alice", "idempotency_key": "fb-2"}
    assert post_feedback(client, keyed).status_code == 201
    changed = post_feedback(client, keyed | {"answer_kept": True, "origin": "reviewer:bob"})
    assert (
        changed.status_code == 422 and "already used for a different observation" in changed.json()["detail"]
    )
    # The first observation by its id only: its values and origin (a label that may name a person)
    # went back to whoever reused the key.
    assert "alice" not in changed.text and "0.3" not in changed.text, changed.text
    both = post_feedback(client, keyed, headers={"Idempotency-Key": "other"})
    assert both.status_code == 422 and "differ" in both.json()["detail"]
    assert count(tx_factory, CalibrationObservation) == 1


def test_every_n_feedbacks_enqueue_a_recompute_after_commit(
    committed_client: TestClient, factory: sessionmaker[Session], committed_recorder: Recorder
) -> None:
    answers = [
        post_feedback(committed_client, {"coverage": 0.1 * i, "answer_kept": i > 1, "origin": "ui"})
        for i in range(4)
    ]
    assert [a.status_code for a in answers] == [201] * 4
    job_ids = [a.json()["recompute_job_id"] for a in answers]
    assert job_ids[:2] == [None, None] and job_ids[2] is not None and job_ids[3] == job_ids[2]
    assert committed_recorder.calls == [
        ("tasks.calibration.recompute", job_ids[2], "calibration")
    ]  # sent once
    assert committed_recorder.committed == [True]


def test_get_calibration_shows_the_fallback_then_the_active_version(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    empty = client.get("/v1/calibration")
    assert empty.status_code == 200
    assert empty.json() == {
        "tau": 0.5,
        "version": None,
        "fallback": True,
        "active": None,
        "observations": {"n": 0, "kept": 0, "lost": 0, "since_last_version": 0, "last_at": None},
        "history": [],
    }
    add(tx_factory, separated())
    first = recompute(tx_factory, **PARAMS)
    add(tx_factory, [ObservationIn(1.0, False, "drift") for _ in range(40)])
    second = recompute(tx_factory, **PARAMS)
    body = client.get("/v1/calibration").json()
    assert (body["tau"], body["version"], body["fallback"]) == (first.tau, first.version, False)
    assert body["active"]["version"] == first.version and body["active"]["active"] is True
    assert [v["version"] for v in body["history"]] == [second.version, first.version]
    assert body["history"][0]["active"] is False and "stays active" in body["history"][0]["reason"]
    assert body["history"][0]["held_out_rate"] < 0.9
    assert body["observations"] | {"last_at": None} == {
        "n": 100, "kept": 30, "lost": 70, "since_last_version": 0, "last_at": None,
    }  # fmt: skip
    assert [v["version"] for v in client.get("/v1/calibration", params={"limit": 1}).json()["history"]] == [
        second.version
    ]
    assert client.get("/v1/calibration", params={"limit": 0}).status_code == 422


def test_openapi_lists_the_calibration_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "post" in paths["/v1/feedback"] and "get" in paths["/v1/calibration"]
    feedback = paths["/v1/feedback"]["post"]
    assert {p["name"] for p in feedback["parameters"]} == {"Idempotency-Key"}
    assert feedback["security"] == [{"ApiKey": []}, {"WebhookSignature": []}]  # a key or a signature


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


# Truncation: the CLI opens its own engine from FACTMILL_DATABASE_URL (so every test_cli_* truncates).
@pytest.fixture
def cli(database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Runs `factmill calibration ...` against the test database, truncated first (``factory``: a test
    that took no factory of its own found the jobs an earlier test committed, "recompute job 1 is
    already pending"); its jobs go to the session's Redis through the real Celery sender
    (``SessionBroker.queued`` reads them)."""
    from worker.cli import app
    from worker.settings import get_settings

    monkeypatch.setenv("FACTMILL_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTMILL_CALIBRATION_RECOMPUTE_EVERY", "1000")
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, ["calibration", *args], catch_exceptions=False)

    try:
        yield invoke
    finally:
        get_settings.cache_clear()


def test_cli_add(cli: Any, factory: sessionmaker[Session]) -> None:
    result = cli("add", "--coverage", "0.7", "--kept", "--origin", "reviewer")
    assert result.exit_code == 0, result.output
    assert "observation 1 added (coverage 0.7, answer kept)" in result.output
    result = cli("add", "--coverage", "0.2", "--lost", "--key", "k", "--json")
    assert json.loads(result.stdout) == {"id": 2, "duplicate": False, "recompute_job_id": None, "enqueued": 0}
    assert "duplicate" in cli("add", "--coverage", "0.2", "--lost", "--key", "k").output
    with factory() as session:
        rows = session.execute(
            select(
                CalibrationObservation.coverage,
                CalibrationObservation.answer_kept,
                CalibrationObservation.origin,
            )
        ).all()
        assert sorted(rows) == [(0.2, False, "cli"), (0.7, True, "reviewer")]


@pytest.mark.parametrize("value", ["nan", "1.5", "-1"])
def test_cli_add_refuses_bad_coverage(cli: Any, factory: sessionmaker[Session], value: str) -> None:
    result = cli("add", "--coverage", value, "--kept")
    assert result.exit_code == 2
    assert "coverage must be a number from 0 to 1" in result.output
    assert count(factory, CalibrationObservation) == 0


def test_cli_add_needs_a_label(cli: Any) -> None:
    result = cli("add", "--coverage", "0.5")
    assert result.exit_code == 2 and "--kept" in result.output


def test_cli_import_reports_bad_rows_by_line(
    cli: Any, tmp_path: Path, committed_judged: tuple[int, ...]
) -> None:
    path = tmp_path / "labels.csv"
    path.write_text(CSV)
    result = cli("import", str(path))
    assert result.exit_code == 1, result.output  # the good rows stored; a script must see rows were dropped
    assert "6 row(s): 3 added, 0 duplicate(s), 3 error(s)" in result.output
    assert "line 3:" in result.output and "line 6:" in result.output and "line 8:" in result.output
    report = json.loads(cli("import", str(path), "--json").stdout)
    assert (report["added"], report["duplicates"], [e["line"] for e in report["errors"]]) == (0, 3, [3, 6, 8])
    bad = tmp_path / "bad.csv"
    bad.write_text("nan,true\n2,false\n")
    assert cli("import", str(bad)).exit_code == 1  # nothing usable
    missing = cli("import", str(tmp_path / "missing.csv"))
    assert missing.exit_code == 2 and "no such file" in missing.output
    # An --origin no row can take was refused on every row, a line each: once, before any row.
    tabbed = cli("import", str(path), "--origin", "a\tb")
    assert tabbed.exit_code == 2 and "origin must be 1 to 200 printable characters" in tabbed.output
    assert tabbed.output.count("\n") <= 2, tabbed.output
    odd = tmp_path / "tab\tname.csv"  # a name no origin can hold: its rows take the file's digest
    odd.write_text("0.9,true\n")
    assert cli("import", str(odd)).exit_code == 0
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("0.5,true,caf\xe9\n".encode("latin-1"))
    refused = cli("import", str(latin1))
    assert refused.exit_code == 2 and refused.output.count(str(latin1)) == 1, refused.output  # named once
    assert "is not UTF-8 text" in refused.output
    hashed = tmp_path / "hashed.csv"
    hashed.write_text("origin,coverage,answer_kept\n#nightly,0.4,false\n")
    said = cli("import", str(hashed))
    assert (
        said.exit_code == 0 and "1 line(s) starting with # were skipped as comments (line 2)" in said.output
    )
    assert json.loads(cli("import", str(hashed), "--json").stdout)["comment_lines"] == [2]


def test_cli_recompute_now_show_history_and_plot(
    cli: Any, factory: sessionmaker[Session], tmp_path: Path
) -> None:
    shown = cli("show")
    assert shown.exit_code == 0 and "τ = 0.5 (fallback" in shown.output
    assert "no threshold versions yet" in cli("history").output
    add(factory, separated())
    result = cli("recompute", "--now")
    assert result.exit_code == 0, result.output
    assert "version 1 activated" in result.output and "meets the target" in result.output
    assert "nothing new since version 1" in cli("recompute", "--now").output
    assert "version 2" in cli("recompute", "--now", "--force").output
    show = json.loads(cli("show", "--json").stdout)
    assert show["version"] == 2 and show["fallback"] is False and show["observations"]["n"] == 60
    history = json.loads(cli("history", "--json").stdout)
    assert [h["version"] for h in history] == [2, 1] and history[0]["active"]
    listing = cli("history").output
    assert "held-out" in listing and "version 1: held-out answer-kept rate 1 (15 of 15" in listing
    plot = tmp_path / "calibration.png"
    result = cli("show", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    data = plot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    from PIL import Image

    with Image.open(plot) as image:
        image.verify()
    # A name that is not UTF-8 (a Latin-1 terminal's "café"): written, then its report was a traceback.
    latin1 = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.png"))
    named = cli("show", "--plot", latin1)
    assert named.exit_code == 0 and "caf\\xe9.png" in named.output, named.output
    named = cli("show", "--plot", latin1, "--json")
    assert named.exit_code == 0 and json.loads(named.stdout)["plot"].endswith("caf\\xe9.png")


def test_cli_recompute_now_honours_the_kill_switch(cli: Any, factory: sessionmaker[Session]) -> None:
    add(factory, separated())
    with factory.begin() as session:
        set_config(session, CALIBRATION_ENABLED, "off", updated_by="test")
    refused = cli("recompute", "--now")
    assert refused.exit_code == 3 and "calibration is disabled" in refused.output
    assert versions(factory) == []
    assert cli("recompute", "--now", "--override-disabled").exit_code == 0
    assert len(versions(factory)) == 1
    assert cli("recompute", "--override-disabled").exit_code == 2  # only with --now


def test_cli_retire_puts_the_gates_back_on_the_fallback_until_a_recompute_earns_a_version(
    cli: Any, factory: sessionmaker[Session]
) -> None:
    """No way out of a τ an operator distrusts: calibration.enabled=false pauses recomputes only (the
    gates kept the version), and the only other lever, compaction.quality_gate, stops gating at all."""
    add(factory, separated())
    assert cli("recompute", "--now").exit_code == 0
    earned = current(factory)
    assert earned.version is not None
    retired = cli("retire")
    assert retired.exit_code == 0 and f"version {earned.version} (τ = " in retired.output, retired.output
    assert current(factory) == FALLBACK
    # The version's history says so (else it looked replaced by a successor that never came).
    [row] = [v for v in versions(factory) if v.version == earned.version]
    assert not row.active and re.search(
        r"; retired by hand at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", row.reason
    )
    # Nothing new: the next recompute writes nothing and activates nothing; --force evaluates again.
    assert cli("recompute", "--now").exit_code == 0 and current(factory) == FALLBACK
    again = cli("retire", "--json")
    assert json.loads(again.stdout) == {"retired_version": None, "retired_tau": None}
    assert cli("recompute", "--now", "--force").exit_code == 0 and current(factory).version is not None


def advisory_waiter(factory: sessionmaker[Session]) -> bool:
    """Whether a session of this test's database waits for an advisory lock (pg_locks is the
    cluster's: another test process's waiter counted)."""
    with factory() as session:
        return bool(
            session.scalar(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            )
        )


def test_cli_recompute_now_turned_off_while_it_waits_for_the_lock_writes_nothing(
    cli: Any, factory: sessionmaker[Session]
) -> None:
    """It checked the switch once, then waited behind a running recompute and activated a τ after the
    switch had gone off (the job path checks again before writing; the CLI did not)."""
    import threading

    from worker.calibration.queries import lock_recompute

    add(factory, separated())
    outcome: list[Any] = []
    with factory.begin() as holder:  # a recompute in progress: holds the lock
        lock_recompute(holder)
        waiting = threading.Thread(target=lambda: outcome.append(cli("recompute", "--now")))
        waiting.start()
        # Until the command waits on the lock (a poll that fell through flipped the switch before it
        # waited, and the test passed with or without the check it guards).
        wait_for(lambda: advisory_waiter(factory), 30, "the command to wait on the recompute lock")
        with factory.begin() as session:
            set_config(session, CALIBRATION_ENABLED, "off", updated_by="test")
    waiting.join(timeout=60)
    [refused] = outcome
    assert refused.exit_code == 3 and "calibration is disabled" in refused.output, refused.output
    assert versions(factory) == []


def test_a_version_is_dated_when_it_was_written_not_when_its_recompute_began_waiting(
    factory: sessionmaker[Session],
) -> None:
    import threading

    from worker.calibration import recompute
    from worker.calibration.queries import lock_recompute

    add(factory, separated())
    with factory.begin() as holder:  # a recompute in progress: holds the lock
        lock_recompute(holder)
        waiting = threading.Thread(
            target=recompute,
            args=(factory,),
            kwargs={"alpha": 0.1, "target_recall": 0.9, "min_observations": 20},
        )
        waiting.start()
        wait_for(lambda: advisory_waiter(factory), 30, "the second recompute to wait on the lock")
        released = holder.scalar(text("SELECT clock_timestamp()"))
    waiting.join(timeout=60)
    [version] = versions(factory)
    assert version.active and version.computed_at >= released and version.activated_at >= released


def test_cli_recompute_queues_one_job(cli: Any, broker: SessionBroker) -> None:
    before = broker.queued("calibration")
    first = cli("recompute")
    assert first.exit_code == 0 and "recompute job 1 queued" in first.output
    assert "recompute job 1 is already pending" in cli("recompute").output
    assert broker.queued("calibration") - before == Counter({("tasks.calibration.recompute", 1): 1})
    assert cli("recompute", "--force").exit_code == 2


def test_cli_plot_without_matplotlib_or_data(
    cli: Any, factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = cli("show", "--plot", str(tmp_path / "none.png"))
    assert empty.exit_code == 1 and "no observations to plot" in empty.output
    add(factory, separated(4, 4))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = cli("show", "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 2 and "the plot needs matplotlib" in result.output
    assert not (tmp_path / "x.png").exists()


def test_cli_refuses_a_database_without_the_schema(
    cli: Any, server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import fresh_database
    from worker.settings import get_settings

    with fresh_database(server_url, "noschema") as url:
        monkeypatch.setenv("FACTMILL_DATABASE_URL", url)
        get_settings.cache_clear()
        result = cli("history")
    assert result.exit_code == 1 and "factmill db upgrade" in result.output


# ---------------------------------------------------------------------------
# A real Celery worker on the calibration queue
# ---------------------------------------------------------------------------


# Truncation: a real Celery worker process reads and writes the rows (test_a_real_worker_*).
@pytest.fixture
def worker_env(database_url: str, broker_url: str, simulator: Any) -> dict[str, str]:
    return service_env(database_url, broker_url, simulator.base_url, calibration_min_observations=20)


@pytest.fixture
def celery_client(worker_env: dict[str, str]) -> Iterator[Celery]:
    celery = create_celery_app(
        Settings(
            broker_url=worker_env["FACTMILL_BROKER_URL"],
            broker_key_prefix=worker_env["FACTMILL_BROKER_KEY_PREFIX"],
        )
    )
    yield celery
    celery.close()


def job_status(factory: sessionmaker[Session], job_id: int) -> str | None:
    with factory() as session:
        return session.scalar(select(Job.status).where(Job.id == job_id))


@pytest.mark.timeout(180)
def test_a_real_worker_recomputes_and_beat_schedules(
    factory: sessionmaker[Session], worker_env: dict[str, str], celery_client: Celery
) -> None:
    add(factory, separated())

    def send(task_name: str, job_id: int, queue: str) -> None:
        celery_client.send_task(task_name, args=[job_id], queue=queue)

    worker = start_worker(worker_env, queues="calibration", concurrency=2)
    with running(worker):
        request = request_recompute(factory, "manual", sender=send)
        wait_for(
            lambda: job_status(factory, request.job_id) == "succeeded",
            60,
            "the recompute job to succeed",
            diagnostics=lambda: f"{job_status(factory, request.job_id)}\n{worker.tail()}",
        )
        assert current(factory).version == 1
        # What beat sends: the schedule task requests a job itself and the worker runs it.
        add(factory, [ObservationIn(1.0, False, "drift") for _ in range(40)])
        celery_client.send_task("tasks.calibration.schedule", queue="calibration")
        wait_for(lambda: len(versions(factory)) == 2, 60, "the scheduled recompute",
                 diagnostics=worker.tail)  # fmt: skip
    with factory() as session:
        scheduled = session.scalars(select(Job).where(Job.id != request.job_id)).one()
        assert (scheduled.kind, scheduled.status, scheduled.options) == (
            "calibration",
            "succeeded",
            {"trigger": "schedule"},
        )
    first, second = versions(factory)
    assert first.active and first.job_id == request.job_id
    assert not second.active and second.trigger == "schedule" and "stays active" in second.reason
    assert "tasks.calibration.recompute" in "".join(worker.output)


def test_the_beat_schedule_has_the_calibration_entry() -> None:
    from worker.celery_app import celery_config

    schedule = celery_config(Settings(broker_url="redis://x", calibration_schedule_seconds=120))[
        "beat_schedule"
    ]
    entry = schedule["calibration-recompute"]
    assert entry["task"] == "tasks.calibration.schedule" and entry["schedule"] == 120
    assert entry["options"]["queue"] == "calibration"


def test_a_recompute_that_never_finds_the_observations_lock_free_gives_up_and_shows_life(
    factory: sessionmaker[Session],
) -> None:
    """Under steady feedback the try-lock never found a moment free: the recompute spun without a sign
    of life until its lease lapsed, holding a pooled connection. Now each wait marks progress, and past
    its patience it queues for the lock briefly, then gives up (the job retries later)."""
    from sqlalchemy import text

    from worker.calibration.queries import OBSERVATIONS_LOCK_ID, ObservationsBusyError, observations_bound
    from worker.core import progress

    marks: list[int] = []
    with factory.begin() as storing:  # a storing transaction that never ends
        storing.execute(text("SELECT pg_advisory_xact_lock_shared(:id)"), {"id": OBSERVATIONS_LOCK_ID})
        progress.listen(lambda: marks.append(1))
        try:
            with factory.begin() as session, pytest.raises(ObservationsBusyError):
                observations_bound(session, poll_seconds=0.05, patience=0.3)
        finally:
            progress.listen(None)
    assert len(marks) >= 3
    with factory.begin() as session:  # free again: the bound is read at once
        assert observations_bound(session, patience=0.3) is None
    # Taken through the queue (a storing transaction ends while it waits there): the recompute's own
    # lock_timeout is back for the rest of its transaction.
    held = threading.Event()

    def store_briefly() -> None:
        with factory.begin() as storing:
            storing.execute(text("SELECT pg_advisory_xact_lock_shared(:id)"), {"id": OBSERVATIONS_LOCK_ID})
            held.set()
            time.sleep(0.5)

    storer = threading.Thread(target=store_briefly)
    storer.start()
    held.wait(5)
    with factory.begin() as session:
        before = session.scalar(text("SELECT current_setting('lock_timeout')"))
        assert observations_bound(session, poll_seconds=0.05, patience=0.1) is None
        assert session.scalar(text("SELECT current_setting('lock_timeout')")) == before
    storer.join(5)


def test_a_session_lock_whose_unlock_cannot_run_goes_with_its_connection(
    factory: sessionmaker[Session], database_url: str
) -> None:
    """The observations' exclusive lock is session-level: a rollback does not release it. An error that
    left the transaction failed before the unlock sent the pooled connection back still holding it, and
    every storing transaction (feedback, imports) queued behind it for good."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    from worker.calibration.queries import OBSERVATIONS_LOCK_ID, release_session_lock

    lock = {"id": OBSERVATIONS_LOCK_ID}
    session = factory()
    try:
        assert session.scalar(text("SELECT pg_advisory_lock(:id) IS NULL"), lock) is not None
        with pytest.raises(DBAPIError):
            session.execute(text("SELECT 1 / 0"))  # the transaction is failed: no statement runs now
        with pytest.raises(DBAPIError):
            release_session_lock(session, OBSERVATIONS_LOCK_ID)
    finally:
        session.close()
    # Asked on a connection of its own (a pooled one may be the very connection that holds it).
    other = create_engine(database_url, poolclass=NullPool)
    try:
        with other.begin() as connection:  # free: the connection that held it was closed
            assert connection.scalar(text("SELECT pg_try_advisory_xact_lock(:id)"), lock) is True
    finally:
        other.dispose()
