"""The calibration job kind: one recompute of τ per job, on the calibration queue."""

from __future__ import annotations

from worker.calibration.queries import ObservationsBusyError
from worker.calibration.service import recompute
from worker.calibration.store import CalibrationStore
from worker.config_store import CALIBRATION_ENABLED
from worker.jobs.lifecycle import JobContext, WorkResult, paused_reason
from worker.jobs.outbox import CALIBRATION
from worker.jobs.registry import ErrorRule, JobKind, KillSwitchOffError, register

PAUSED_REASON = paused_reason(CALIBRATION_ENABLED)


def recompute_job(ctx: JobContext) -> WorkResult:
    """The calibration job kind's work: recompute τ from the observations and activate it if it holds."""
    settings = ctx.rt.settings

    def guard() -> None:  # before the version is written and activated
        ctx.guard()
        if not ctx.enabled():  # turned off while the recompute waited for its lock: no new τ goes live
            raise KillSwitchOffError(PAUSED_REASON)

    result = recompute(
        CalibrationStore(ctx.rt.factory),
        alpha=settings.calibration_alpha,
        target_recall=settings.calibration_target_recall,
        min_observations=settings.calibration_min_observations,
        trigger=str(ctx.option("trigger", "manual")),
        job_id=ctx.job.id,
        guard=guard,
    )
    return WorkResult("succeeded", counters=result.as_dict(), detail=result.reason)


KIND = register(
    JobKind(
        name=CALIBRATION,
        task_name="tasks.calibration.recompute",
        queue="calibration",
        switch=CALIBRATION_ENABLED,
        work=recompute_job,
        # Bad settings: retrying cannot help. The observations' lock held by an import or a stream of
        # feedback: sent again, spending the worker-loss budget, not an attempt (unsorted, minutes of
        # contention failed the job, its note "ObservationsBusyError at queries.py").
        errors=(ErrorRule(ValueError, "fail"), ErrorRule(ObservationsBusyError, "requeue")),
    )
)
