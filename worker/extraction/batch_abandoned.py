"""What a batch run that stops leaves at the provider: the batch it sent (owed, cancelled), or the send it
stopped in (looked up by its key), so no batch, and no upload of the pages' text, is left named nowhere."""

from __future__ import annotations

import logging
from datetime import datetime

from worker.extraction.store import ExtractionStore
from worker.llm.batch_api import BatchLLMClient
from worker.llm.errors import LLMError

logger = logging.getLogger(__name__)


def cancel_abandoned(client: BatchLLMClient, batch_id: str) -> None:
    """A batch the run stops waiting for (Ctrl-C, SIGTERM, polls that failed for good) is cancelled:
    left running, it was billed whole and its results deleted unread, and the next run paid again."""
    try:
        client.cancel(batch_id)
    except Exception as exc:  # (or it ended meanwhile); a second Ctrl-C stops the cancel, its delete owed
        logger.error("batch %s could not be cancelled (%s); it may run on at the provider", batch_id, exc)
    else:
        logger.warning("batch %s: the run stopped waiting for it; cancelled", batch_id)


def owe_abandoned(store: ExtractionStore, provider: str, batch_id: str, exc: BaseException) -> None:
    """A run that stops between its batch's create and its collection leaves the batch, and its files
    (the pages' text), at the provider, and nothing else knew its id: owe their delete (beat's poll
    deletes them once it has ended). The run's own error is what the caller sees."""
    try:
        store.provider_copies.owe(
            provider, batch_id, f"the run stopped before collecting it ({type(exc).__name__})"
        )
    except Exception as owed:
        logger.error("batch %s is left at the provider and could not be recorded (%s)", batch_id, owed)
    else:
        logger.warning("batch %s: the run stopped before collecting it; its delete is owed", batch_id)


def abandon_send(
    store: ExtractionStore, client: BatchLLMClient, key: str, started: datetime, exc: BaseException
) -> None:
    """The send of batch ``key`` stopped without the provider's answer (Ctrl-C or SIGTERM in an upload
    or create of minutes, a timeout, a 5xx): the create may have been taken, the batch billed, with no
    row knowing it. Looked up by its key, a batch found is owed and cancelled; with none, what the send
    uploaded is deleted. (A create refused outright, a 4xx, left nothing: the client deleted its upload.)"""
    if isinstance(exc, LLMError) and not exc.retryable and exc.status is not None and 400 <= exc.status < 500:
        return
    try:
        found = client.find(key, started)
        if isinstance(found, str):
            owe_abandoned(store, client.provider, found, exc)
            cancel_abandoned(client, found)
        elif found is None:
            client.forget_uploads(key)
        else:  # Anthropic keeps no metadata: a batch still running (this one, just taken) may be it
            logger.error(
                "batch %s: the send stopped, and %s cannot tell yet whether it took it; a batch whose "
                "custom ids begin with %s- may run there", key, client.provider, key,
            )  # fmt: skip
    except Exception as lookup:  # (a second Ctrl-C is a BaseException: it stops the lookup)
        logger.error(
            "batch %s: the send stopped, and looking for it at %s failed (%s); a batch whose custom ids "
            "begin with %s- may run there", key, client.provider, lookup, key,
        )  # fmt: skip
