"""A sweep for the tests: every step must have run without failing (a failed step reports its
fallback, 0, which a test asserting "nothing done" would take for the answer)."""

from __future__ import annotations

from typing import Any

from worker.jobs.maintenance import MaintenanceReport, maintain
from worker.runtime import Runtime


def maintained(rt: Runtime, **batches: Any) -> MaintenanceReport:
    report = maintain(rt, **batches)
    assert report.failed == [], f"maintenance steps failed: {report.failed}"
    return report
