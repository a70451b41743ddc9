"""What holds a backfill's batch back: the budgets while batches are in flight (``within_budget``), and a
provider's queued-token limit.

The queued-token limit: a batch it failed for going past it is sent again later, alone, and
while one waits so, a backfill sends nothing beside another batch in flight.

OpenAI takes a batch's create, then fails the whole batch ("token_limit_exceeded", none of its requests
run) when the organisation's queued tokens would pass its limit; a default batch of 95 MB can pass a low
tier's limit alone. Collected as failed, its requests counted expired and the backfill ended "done"
with those pages never extracted; a new backfill sent everything at once again, and failed alike. A
batch that fails so MAX_LIMIT_FAILURES times, the last ones sent alone, is over the limit by itself: it
is collected as failed then, saying to cut smaller batches (sent again for good, it uploaded the pages'
text every ten minutes)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING

from sqlalchemy import exists, func, or_, select, update

from models import BackfillBatch
from models.reads import read_only
from worker.extraction.backfill_rows import BatchRow
from worker.extraction.backfill_store import SEND_FAILED
from worker.extraction.provider_copies import ProviderCopies, discard_batch
from worker.llm.batch_api import PROVIDER_WINDOW, BatchItem, BatchLLMClient, BatchStatus
from worker.llm.errors import LLMError
from worker.llm.types import ChatRequest

if TYPE_CHECKING:  # (the pass calls these: a module of its own keeps it readable)
    from worker.extraction.backfill import BackfillPass

logger = logging.getLogger(__name__)

QUEUED_LIMIT_CODES = ("token_limit_exceeded",)
OVER_QUEUED_LIMIT = "over the provider's queued-token limit"
MAX_LIMIT_FAILURES = 3


def failed_over_queued_limit(status: BatchStatus) -> bool:
    return status.status == "failed" and any(code in (status.error or "") for code in QUEUED_LIMIT_CODES)


def planned_again(run: BackfillPass, batch: BatchRow, status: BatchStatus) -> bool:
    """Whether an ended batch is taken care of here (failed over the limit: planned again, or moved on
    by another run meanwhile); False: the caller collects it."""
    return failed_over_queued_limit(status) and send_again_later(run, batch, status.said())


def send_again_later(run: BackfillPass, batch: BatchRow, said: str) -> bool:
    """The failed batch's files deleted (the pages' text), and the batch planned again with its requests
    (none ran), to be sent once a failed send's wait is over (RESEND_AFTER_SECONDS). False, nothing
    changed, when it failed so MAX_LIMIT_FAILURES times: the caller collects it as failed. (True,
    nothing changed, when another run moved it on meanwhile.)"""
    assert batch.provider_batch_id is not None
    this_copy = (
        BackfillBatch.id == batch.id,
        BackfillBatch.provider_batch_id == batch.provider_batch_id,  # not a copy another run sent since
        BackfillBatch.status == "submitted",
    )
    # Owed first: a worker killed after the batch is planned again (its id gone from it) and before the
    # delete left the failed copy's files (the pages' text) at the provider, named nowhere. Every way on
    # settles it: deleted below, collected as failed (the caller), or moved on by another run's collect.
    copies = ProviderCopies(run.deps.factory)
    copies.owe(
        run.deps.client.provider, batch.provider_batch_id, f"failed over the queued-token limit: {said}"
    )
    with run.deps.factory.begin() as session:
        failures = session.execute(
            update(BackfillBatch)
            .where(*this_copy, BackfillBatch.limit_failures < MAX_LIMIT_FAILURES - 1)
            .values(
                status="planned",
                provider_batch_id=None,
                estimated_cost_usd=None,
                provider_status=f"{SEND_FAILED} ({OVER_QUEUED_LIMIT}: {said})"[:500],
                submit_started_at=func.now(),  # the resend waits from now
                limit_failures=BackfillBatch.limit_failures + 1,
            )
            .returning(BackfillBatch.limit_failures)
        ).scalar_one_or_none()
        still_this = failures is None and session.scalar(select(func.count()).where(*this_copy))
    if failures is None and not still_this:
        return True  # moved on by another run: nothing here to collect or send
    if failures is None:
        logger.warning(
            "backfill %s: batch %s is over the provider's queued-token limit by itself (%d times); its "
            "requests are counted expired: cut smaller batches (FACTMILL_BACKFILL_BATCH_MAX_BYTES)",
            run.backfill.id, batch.key, MAX_LIMIT_FAILURES,
        )  # fmt: skip
        return False
    discard_batch(run.deps.client, batch.provider_batch_id, copies)
    logger.warning(
        "backfill %s: batch %s failed over the provider's queued-token limit; sent again alone later",
        run.backfill.id, batch.key,
    )  # fmt: skip
    return True


def results_kept(
    client: BatchLLMClient, batch_id: str, requests: Mapping[str, ChatRequest]
) -> dict[str, BatchItem]:
    """An ended batch's results, or none when the provider keeps them no more (a 404: Anthropic's after
    29 days, an OpenAI output file expired or deleted): its pending requests are then missing. Raised,
    the backfill waited on the batch for good, and a cancel could not end it (it collects first)."""
    try:
        return client.results(batch_id, requests)
    except LLMError as exc:
        if exc.status != 404:
            raise
        logger.warning("batch %s: the provider keeps its results no more; its requests are missing", batch_id)
        return {}


def waits_for_room(run: BackfillPass) -> bool:
    """Whether the backfill's sends wait for the batches in flight at its provider to end: while a batch
    (of any backfill) failed over the limit waits to go again, or is out again to see whether it fits
    alone, nothing is sent beside another (it would pass the limit again, and the batch be given up
    though it fits alone)."""
    # The limit is the organisation's: every backfill's batches at this provider count (another
    # backfill's sends beside a limited resend failed it again, and it was given up though it fit
    # alone); another's only for a day from its send, the provider's completion window (one whose job
    # failed, or cannot reach its batches, collects nothing: counted for good, it held every backfill's
    # sends at the provider; its batch's queued tokens are freed when the provider ends it).
    recent = (
        func.coalesce(BackfillBatch.submitted_at, BackfillBatch.submit_started_at)
        > func.now() - PROVIDER_WINDOW
    )
    counted = (BackfillBatch.provider == run.deps.client.provider) & (
        (BackfillBatch.backfill_id == run.backfill.id) | recent
    )
    limited = exists().where(
        counted,
        or_(
            (BackfillBatch.status == "planned") & BackfillBatch.provider_status.contains(OVER_QUEUED_LIMIT),
            (BackfillBatch.status == "submitted") & (BackfillBatch.limit_failures > 0),
        ),
    )
    in_flight = exists().where(counted, BackfillBatch.status == "submitted")
    with read_only(run.deps.factory) as session:
        return bool(session.scalar(select(limited & in_flight)))


__all__ = [
    "MAX_LIMIT_FAILURES",
    "OVER_QUEUED_LIMIT",
    "failed_over_queued_limit",
    "planned_again",
    "results_kept",
    "send_again_later",
    "waits_for_room",
]


def within_budget(run: BackfillPass, batch: BatchRow, estimate: Decimal) -> bool:
    """Whether ``batch`` (at most ``estimate``) may go now. A batch's spend is known only once it is
    collected, hours later (a pass that sent ten checked $0 spent ten times), so what is left of the
    day's and this job's budgets must also cover the batches in flight (their estimates): else it
    waits for them (False). With none in flight it goes (it may overshoot, as calls in flight may)."""
    day_left, job_left = run.deps.budget.room(run.deps.job_id)
    # Not this batch's own estimate: one found "submitting" that the provider never got is sent again.
    in_flight = run.store.in_flight_estimate(but=batch.id)
    mine = run.store.in_flight_estimate(run.backfill.id, but=batch.id)
    for scope, left, flying in (("day", day_left, in_flight), ("job", job_left, mine)):
        if left is not None and flying + estimate > left and flying > 0:
            logger.info(
                "backfill %s: batch %s waits for the $%.4f in flight: the %s budget has $%.4f left",
                run.backfill.id, batch.key, flying, scope, left,
            )  # fmt: skip
            return False
    return True
