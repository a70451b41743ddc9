"""The two job budgets as values, and which database errors count as the database going away."""

from __future__ import annotations

import logging

import psycopg
import pytest
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from worker.db import database_unavailable, database_went_away
from worker.jobs.budgets import JobBudgets
from worker.jobs.lifecycle import classify, result_for_error
from worker.jobs.registry import Backoff, get_kind
from worker.settings import Settings


def test_each_budget_is_spent_at_its_own_cap():
    budgets = JobBudgets(max_attempts=5, max_worker_losses=20)
    assert budgets.spent_reason(4, 19) is None
    assert budgets.spent_reason(5, 0) == "attempts spent (5 of 5); retry it by hand to start over"
    assert budgets.spent_reason(0, 20) == "worker lost 20 times"
    assert budgets.spent_reason(7, 21) == "worker lost 21 times"  # the loss is what crash-looped


def test_budgets_come_from_settings_and_refuse_zero():
    assert JobBudgets.from_settings(Settings()) == JobBudgets(5, 20)
    assert JobBudgets.from_settings(Settings(job_max_worker_losses=3)).max_worker_losses == 3
    with pytest.raises(ValueError, match="at least 1"):
        JobBudgets(max_attempts=0, max_worker_losses=1)


def wrapped(sqlstate: str | None, invalidated: bool = False) -> OperationalError:
    """SQLAlchemy's wrapper around the psycopg error class the server's SQLSTATE maps to."""
    orig = psycopg.errors.lookup(sqlstate)("server said no") if sqlstate else psycopg.OperationalError("gone")
    return OperationalError("SELECT 1", {}, orig, connection_invalidated=invalidated)


@pytest.mark.parametrize(
    ("error", "action"),
    [
        (wrapped("40P01"), "retry"),  # a deadlock: the job's own failure
        (wrapped("57014"), "retry"),  # a statement timeout
        (wrapped("40P01", invalidated=True), "requeue"),  # the connection broke under it
        (wrapped("57P01"), "requeue"),  # terminated by an administrator (a restart)
        (wrapped("08006"), "requeue"),  # connection failure
        (wrapped(None), "requeue"),  # the server never answered
    ],
)
def test_the_database_going_away_is_a_worker_loss_and_other_database_errors_are_attempts(error, action):
    assert database_went_away(error) is (action == "requeue")
    rule = classify(get_kind("extraction"), error)
    assert rule is not None and rule.action == action


@pytest.mark.parametrize("sqlstate", ["53100", "53200", "53300"])  # disk full, out of memory, connections
def test_a_server_out_of_resources_is_a_worker_loss_not_an_attempt(sqlstate: str) -> None:
    """Retried as the job's own failure, a disk full for two minutes failed every job in flight for
    good (five attempts spent in about 75 s of backoff)."""
    rule = classify(get_kind("extraction"), wrapped(sqlstate))
    assert rule is not None and rule.action == "requeue"
    assert database_unavailable(wrapped(sqlstate)) and not database_went_away(wrapped(sqlstate))


def test_a_configured_limit_the_statement_passes_is_the_jobs_own_failure() -> None:
    """53400 (temp_file_limit, say): the statement passes it the same way every time."""
    rule = classify(get_kind("extraction"), wrapped("53400"))
    assert rule is not None and rule.action == "retry" and not database_unavailable(wrapped("53400"))


def test_a_pool_timeout_is_a_worker_loss_not_an_attempt():
    """Every pooled connection busy past the pool's timeout (64 job threads, their heartbeats, the pipe's
    budget checks): retried as the job's own failure, five of them failed the page for good."""
    rule = classify(get_kind("extraction"), PoolTimeoutError("QueuePool limit of size 40 reached"))
    assert rule is not None and rule.action == "requeue"


SECRET = "Alice's private diagnosis"


def raised(error: Exception) -> Exception:
    """``error`` with a traceback, as the lifecycle meets it."""
    try:
        raise error
    except Exception as exc:
        return exc


def test_a_database_error_is_noted_by_its_classes_not_by_the_values_it_quotes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timeout = psycopg.errors.lookup("57014")("canceling statement due to statement timeout")
    known = raised(OperationalError("INSERT INTO facts ...", {"fact": SECRET}, timeout))
    assert result_for_error(get_kind("extraction"), known).note == (
        "OperationalError: QueryCanceled (SQLSTATE 57014)"
    )
    # An unsorted one (a bug) is retried, and its log line names it and where, not its message.
    bad_input = psycopg.errors.lookup("22P02")(f'invalid input syntax for type integer: "{SECRET}"')
    unsorted = raised(DataError("SELECT ...", {"fact": SECRET}, bad_input))
    caplog.set_level(logging.INFO)
    result = result_for_error(get_kind("extraction"), unsorted)
    assert result.status == "retry"
    assert result.note == "DataError: InvalidTextRepresentation (SQLSTATE 22P02)"
    assert SECRET not in caplog.text
    # Any other unsorted error: its class and where, not its message (a KeyError quotes the key it missed).
    missed = raised(KeyError(SECRET))
    note = result_for_error(get_kind("extraction"), missed).note or ""
    assert note.startswith("KeyError at ") and "test_job_budgets.py" in note and SECRET not in note
    assert "raised DataError at test_job_budgets.py" in caplog.text
    # One that never reached a server keeps the driver's line: it names no data, only where it went.
    refused = raised(OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused\nmore")))
    assert result_for_error(get_kind("extraction"), refused).note == (
        "OperationalError: OperationalError: connection refused"
    )


def test_a_provider_error_that_is_no_outage_is_retried_and_noted_in_the_providers_words() -> None:
    """A 401 or an unknown model, met by a consolidation: sorted with the unknown errors, the note named
    only "LLMError at ..." and the operator never saw what to fix."""
    from worker.llm.errors import LLMError

    refused = raised(LLMError("HTTP 401: invalid x-api-key", retryable=False, status=401))
    result = result_for_error(get_kind("consolidation"), refused)
    assert result.status == "retry" and "HTTP 401: invalid x-api-key" in (result.note or "")


@pytest.mark.parametrize("attempt", [1, 2, 1025, 1026, 5000, 10**9])
def test_the_backoff_is_bounded_at_any_attempt_a_budget_allows(attempt: int) -> None:
    """2 ** 1025 is past a float: a job's 1,026th loss (a budget raised for a week-long outage) raised
    OverflowError while settling, and the job stayed running with a dead lease."""
    backoff = Backoff(base_seconds=5.0, max_seconds=300.0)
    ceiling = min(300.0, 5.0 * 2 ** (attempt - 1)) if attempt < 10 else 300.0
    assert ceiling / 2 <= backoff.delay(attempt) <= ceiling


def test_the_observations_lock_held_elsewhere_sends_a_recompute_again_without_an_attempt() -> None:
    """A recompute waiting on the observations' lock (an import, a stream of feedback) raised an
    unsorted error: each spent an attempt, minutes of contention failed the job, its note naming a file."""
    from worker.calibration.queries import ObservationsBusyError

    result = result_for_error(get_kind("calibration"), ObservationsBusyError("the observations are busy"))
    assert result.status == "requeue"
