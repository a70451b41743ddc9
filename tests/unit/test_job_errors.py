"""The one table that sorts a job's exceptions: each class of failure to its action."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from worker.jobs.lifecycle import classify
from worker.jobs.registry import JobKind


def _work(ctx: object) -> object:
    raise AssertionError("not run")


KIND = JobKind(name="k", task_name="tasks.k", queue="q", switch="k.enabled", work=_work)  # type: ignore[arg-type]


def action(exc: BaseException) -> str | None:
    rule = classify(KIND, exc)
    return None if rule is None else rule.action


def test_a_pool_timeout_is_infrastructure_not_the_job_s_failure() -> None:
    """Every pooled connection busy past the pool's timeout (64 job threads, their heartbeats, the pipe's
    budget checks): retried as the job's own failure, five of them failed the page for good."""
    assert action(PoolTimeoutError("QueuePool limit of size 40 overflow 40 reached")) == "requeue"


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [("08006", "requeue"), ("57P01", "requeue"), ("40P01", "retry"), ("57014", "retry")],
)
def test_a_database_error_is_sorted_by_its_sqlstate(sqlstate: str, expected: str) -> None:
    class Driver(psycopg.OperationalError):
        pass

    Driver.sqlstate = sqlstate  # type: ignore[attr-defined,misc]
    assert action(OperationalError("SELECT 1", {}, Driver("x"))) == expected


def test_an_unknown_error_has_no_row() -> None:
    assert action(KeyError("x")) is None
