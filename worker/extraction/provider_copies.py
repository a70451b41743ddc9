"""The provider's copies of ended batches: deleted once their results are committed, and owed (a row in
provider_copies) when that delete fails or the batch has not ended yet; beat's backfill poll deletes
what is owed once the batch has ended.

A batch's files hold the pages' text (an erased page's too) and the facts drawn from it. OpenAI keeps
uploaded and output files until someone deletes them, so a delete that was only logged left them there
for good.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Row, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from models import ProviderCopy
from models.reads import read_only
from worker.core.jsonvalues import made_storable
from worker.llm.batch_api import BatchLLMClient
from worker.llm.batches import BATCH_PROVIDERS, open_batch_client
from worker.llm.errors import LLMError
from worker.llm.retry import RetryPolicy
from worker.settings import Settings

logger = logging.getLogger(__name__)

# A copy whose delete failed is tried again this long after, by the first poll past it (beat polls
# every FACTMILL_BACKFILL_POLL_SECONDS); at most this many a poll, so a long outage's backlog drains
# without one poll holding the worker for minutes.
RETRY_AFTER = timedelta(minutes=5)
SWEEP_LIMIT = 50
ERROR_CHARS = 1000


class ProviderCopies:
    """The owed deletes; each method opens and commits its own transaction."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self._factory = factory

    def owe(self, provider: str, batch_id: str, error: str, *, tried: bool = False) -> None:
        """Record (or, ``tried``, count another failed attempt at) the delete of this batch's copy."""
        row = {"provider": provider, "batch_id": batch_id, "last_error": made_storable(error[:ERROR_CHARS])}
        statement = insert(ProviderCopy).values(row)
        changes = {"last_error": statement.excluded.last_error, "tried_at": func.now()}
        if tried:
            changes["attempts"] = ProviderCopy.attempts + 1
        with self._factory.begin() as session:
            session.execute(
                statement.on_conflict_do_update(index_elements=["provider", "batch_id"], set_=changes)
            )

    def hold(self, provider: str, batch_id: str, until: timedelta) -> None:
        """Record the copy of a batch just sent, its delete not due for ``until``: the run that sent it
        collects it, deletes it and settles this row by then. A run killed before (SIGKILL, the OOM
        killer, a host restart) left the batch and its files (the pages' text) at the provider, and
        nothing knew its id."""
        row = {
            "provider": provider,
            "batch_id": batch_id,
            "last_error": "sent; held for the run collecting it",
            "tried_at": func.now() + until,
        }
        with self._factory.begin() as session:
            session.execute(insert(ProviderCopy).values(row).on_conflict_do_nothing())

    def due(
        self, provider: str, *, retry_after: timedelta = RETRY_AFTER, limit: int = SWEEP_LIMIT
    ) -> list[str]:
        """The batch ids of ``provider`` whose delete is due again, longest waiting first."""
        query = (
            select(ProviderCopy.batch_id)
            .where(ProviderCopy.provider == provider, ProviderCopy.tried_at <= func.now() - retry_after)
            .order_by(ProviderCopy.tried_at, ProviderCopy.id)
            .limit(limit)
        )
        with read_only(self._factory) as session:
            return list(session.scalars(query))

    def wait(self, provider: str, batch_id: str) -> None:
        """The batch has not ended: ask again after RETRY_AFTER (not a failed attempt)."""
        touched = update(ProviderCopy).values(tried_at=func.now())
        with self._factory.begin() as session:
            session.execute(
                touched.where(ProviderCopy.provider == provider, ProviderCopy.batch_id == batch_id)
            )

    def listing(self, limit: int) -> tuple[int, int, Sequence[Row[*tuple[Any, ...]]]]:
        """How many copies are owed, how many more a run still holds (``hold``: not due before its
        ``tried_at``), and the ``limit`` longest on record, as the CLI shows them."""
        columns = (
            ProviderCopy.provider,
            ProviderCopy.batch_id,
            ProviderCopy.attempts,
            ProviderCopy.last_error,
            ProviderCopy.created_at,
            ProviderCopy.tried_at,
        )
        held = ProviderCopy.tried_at > func.now()
        counted = select(func.count().filter(~held), func.count().filter(held)).select_from(ProviderCopy)
        with read_only(self._factory) as session:
            owed, holding = session.execute(counted).one()
            rows = session.execute(select(*columns).order_by(ProviderCopy.id).limit(limit))
            return owed, holding, rows.all()

    def settle(self, provider: str, batch_id: str) -> None:
        gone = delete(ProviderCopy).where(
            ProviderCopy.provider == provider, ProviderCopy.batch_id == batch_id
        )
        with self._factory.begin() as session:
            session.execute(gone)


def forget_uploads(client: BatchLLMClient, key: str) -> None:
    """The uploads earlier sends of batch ``key`` left (their create failed, timed out or never ran)
    deleted, once its lookup found no batch holding the key; a provider that fails it does not hold
    the send back (the next resend tries again). Every upload named by the key goes: bounded by the
    send's start, a sender killed between its upload and its create left that upload (made after the
    start) at the provider for good, named nowhere. (A key is one copy's: models.BackfillBatch.send_key.)
    The price, accepted: a sender whose lease lapsed but which lives on (its heartbeat stalled a
    minute) and whose create is accepted in the seconds between this lookup and this delete loses its
    input file; that batch then fails, and its requests are counted expired (the next run extracts
    them), where the bound left every killed sender's upload, the pages' text, at the provider."""
    try:
        forgotten = client.forget_uploads(key)
    except LLMError as exc:
        logger.warning("batch %s: deleting an earlier send's upload failed (%s)", key, exc)
        return
    if forgotten:
        logger.info("batch %s: deleted %d upload(s) an earlier send left", key, forgotten)


def discard_batch(client: BatchLLMClient, batch_id: str, copies: ProviderCopies) -> bool:
    """Delete the provider's copy of an ended batch whose results are committed. A failure fails no
    run: the delete is owed, and the poll tries it again."""
    try:
        client.discard(batch_id)
    except LLMError as exc:
        copies.owe(client.provider, batch_id, str(exc))
        logger.warning(
            "batch %s: deleting its files at the provider failed (%s); retried later", batch_id, exc
        )
        return False
    copies.settle(client.provider, batch_id)  # held while its run collected it (ProviderCopies.hold)
    return True


@dataclass
class CopiesSwept:
    deleted: int = 0
    waiting: int = 0  # not ended yet
    failed: int = 0


def delete_owed(
    copies: ProviderCopies, client: BatchLLMClient, *, retry_after: timedelta = RETRY_AFTER
) -> CopiesSwept:
    """Delete the due copies of ``client``'s provider whose batches have ended; stop at the first
    failure (the rest are tried by the next poll)."""
    swept = CopiesSwept()
    for batch_id in copies.due(client.provider, retry_after=retry_after):
        try:
            ended = client.status(batch_id).ended
            if ended:
                client.discard(batch_id)
        except LLMError as exc:
            if exc.status == 404:  # the provider has no such batch any more: nothing left to delete
                copies.settle(client.provider, batch_id)
                swept.deleted += 1
                continue
            copies.owe(client.provider, batch_id, str(exc), tried=True)
            swept.failed += 1
            break  # the provider is failing: the rest wait for the next poll, not one call each now
        if not ended:
            copies.wait(client.provider, batch_id)
            swept.waiting += 1
            continue
        copies.settle(client.provider, batch_id)
        swept.deleted += 1
    if swept.deleted or swept.failed:
        logger.info(
            "provider copies: %s deleted, %s failed again, %s batch(es) not ended yet",
            swept.deleted,
            swept.failed,
            swept.waiting,
        )
    return swept


def sweep_provider_copies(
    factory: sessionmaker[Session], settings: Settings, *, retry_after: timedelta = RETRY_AFTER
) -> CopiesSwept:
    """Beat's poll (and `factmill backfill copies --delete`, with ``retry_after`` 0): the owed deletes
    of this deployment's provider that are due (none: no client is opened). Another provider's rows
    wait for a deployment configured with it. Raises LLMConfigurationError when the provider cannot be
    reached as configured."""
    provider = settings.resolved_llm()
    copies = ProviderCopies(factory)
    if provider not in BATCH_PROVIDERS or not copies.due(provider, retry_after=retry_after):
        return CopiesSwept()
    # One try a call: the poll is the retry, and an outage must not hold the worker for the gateway's
    # full backoff (minutes) per owed copy.
    with open_batch_client(settings, RetryPolicy(max_attempts=1)) as client:
        return delete_owed(copies, client, retry_after=retry_after)
