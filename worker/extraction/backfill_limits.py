"""A provider's queued-token limit: a batch it failed for going past it is sent again later, and while
one waits so, a backfill sends one batch at a time.

OpenAI takes a batch's create, then fails the whole batch ("token_limit_exceeded", none of its requests
run) when the organisation's queued tokens would pass its limit; a default batch of 95 MB can pass a low
tier's limit alone. Collected as failed, its requests counted expired and the backfill ended "done"
with those pages never extracted; a new backfill sent everything at once again, and failed alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import func

from worker.extraction.backfill_store import SEND_FAILED, BatchRow
from worker.extraction.provider_copies import ProviderCopies, discard_batch
from worker.llm.batch_api import BatchStatus

if TYPE_CHECKING:  # (the pass calls these: a module of its own keeps it readable)
    from worker.extraction.backfill import BackfillPass

QUEUED_LIMIT_CODES = ("token_limit_exceeded",)
OVER_QUEUED_LIMIT = "over the provider's queued-token limit"


def failed_over_queued_limit(status: BatchStatus) -> bool:
    return status.status == "failed" and any(code in (status.error or "") for code in QUEUED_LIMIT_CODES)


def send_again_later(run: BackfillPass, batch: BatchRow, said: str) -> None:
    """The failed batch's files deleted (the pages' text), and the batch planned again with its requests
    (none ran): sent again once a failed send's wait is over (RESEND_AFTER_SECONDS), by the pass."""
    assert batch.provider_batch_id is not None
    discard_batch(run.deps.client, batch.provider_batch_id, ProviderCopies(run.deps.factory))
    run.store.set_batch(
        batch.id,
        status="planned",
        provider_batch_id=None,
        estimated_cost_usd=None,
        provider_status=f"{SEND_FAILED} ({OVER_QUEUED_LIMIT}: {said})"[:500],
        submit_started_at=func.now(),  # the resend waits from now
    )


def waits_for_room(run: BackfillPass, batch: BatchRow) -> bool:
    """Whether ``batch`` (failed over the limit before) waits for the backfill's batches in flight to
    end: sent beside them, it would pass the limit again."""
    if OVER_QUEUED_LIMIT not in (batch.provider_status or ""):
        return False
    return bool(run.store.batches(run.backfill.id, ("submitted",)))


__all__ = ["OVER_QUEUED_LIMIT", "failed_over_queued_limit", "send_again_later", "waits_for_room"]
