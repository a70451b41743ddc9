"""The search's LLM calls (query expansion, query and fact embeddings): each one, and each try the gateway
retried before it, is a row of llm_calls through the store's ledger, so the `llm.prices` override costs
it; a failed record is logged, never raised (accounting never takes a search down)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from worker.accounting import LLMCallRecord
from worker.core.errors import error_summary, loggable
from worker.core.intent import SearchType
from worker.core.lexing import parse_expansion
from worker.llm.between_tries import CallDeadlineError
from worker.llm.errors import BudgetExhaustedError, NoEmbeddingsError
from worker.llm.retry import AttemptRecord, chat_with_tries, embed_with_tries
from worker.llm.types import ChatResponse, EmbeddingResponse, LLMClient
from worker.search.llm_source import vector_model
from worker.search.prompts import EXPANSION_PURPOSE, expansion_request
from worker.search.store import SearchStore

logger = logging.getLogger(__name__)

EMBEDDING_PURPOSE = "search_embedding"  # vec/hyde lines of a search
FACT_EMBEDDING_PURPOSE = "embedding"  # facts, by `factmill embed` and after extraction


def record(store: SearchStore, call: LLMCallRecord) -> None:
    try:
        store.record_llm_call(call)
    except Exception as exc:  # accounting must never take search down
        logger.warning("could not record a %s LLM call: %s", call.purpose, error_summary(exc))
        logger.debug("traceback of the record's error", exc_info=exc)


def failed_call(purpose: str, llm: LLMClient, exc: BaseException, latency_ms: int) -> LLMCallRecord:
    """The record of a failed call. A fact embedding's keeps the error's status and code, not the
    provider's words: a gateway's 400 may quote its input (fact text, of any pages), and the call is
    under no job an erasure of those pages could find it by."""
    return LLMCallRecord.failed(purpose, llm, exc, latency_ms, words=purpose != FACT_EMBEDDING_PURPOSE)


def record_failure(store: SearchStore, purpose: str, llm: LLMClient, exc: Exception, started: float) -> None:
    record(store, failed_call(purpose, llm, exc, int((time.perf_counter() - started) * 1000)))


def record_tries(store: SearchStore, purpose: str, llm: LLMClient, tries: Sequence[AttemptRecord]) -> None:
    """Each try the gateway retried before a call's answer (or its last failure) is a call of its own."""
    for tried in tries:
        if tried.error is not None:
            record(store, failed_call(purpose, llm, tried.error, tried.latency_ms))


def answered(purpose: str, response: ChatResponse | EmbeddingResponse, outcome: str) -> LLMCallRecord:
    return LLMCallRecord(
        purpose, response.provider, response.model, response.usage, response.latency_ms, outcome
    )


def expand_query(
    store: SearchStore, llm: LLMClient, query: str, intent: str | None
) -> tuple[list[tuple[SearchType, str]], str | None]:
    """(expansion lines, note): an LLM failure yields no lines and a note, never an error."""
    started = time.perf_counter()
    try:
        response, tried = chat_with_tries(llm, expansion_request(query, intent))
    except BudgetExhaustedError:
        # No call was made; readers never see spend or budget figures.
        return [], "query expansion skipped: budget; searched the query alone"
    except CallDeadlineError as exc:  # between two tries: each try made is a call; no call more
        record_tries(store, EXPANSION_PURPOSE, llm, exc.attempts)
        return (
            [],
            "query expansion ran out of time (the LLM was slow); searched the query alone",
        )
    except Exception as exc:
        logger.warning("query expansion failed: %s", loggable(exc))
        record_tries(store, EXPANSION_PURPOSE, llm, getattr(exc, "attempts", ())[:-1])
        record_failure(store, EXPANSION_PURPOSE, llm, exc, started)
        return [], "query expansion failed (the LLM did not answer); searched the query alone"
    record_tries(store, EXPANSION_PURPOSE, llm, tried)
    outcome = "ok" if response.finish == "end" else response.finish
    record(store, answered(EXPANSION_PURPOSE, response, outcome))
    if response.finish == "refusal":
        return [], "query expansion was refused by the model; searched the query alone"
    return parse_expansion(response.text, query), None


def embed_texts(
    store: SearchStore, llm: LLMClient, texts: list[str], purpose: str
) -> tuple[list[list[float]], str]:
    """One embedding call for ``texts``, accounted under ``purpose``: (the vectors, their model)."""
    vectors, call = call_embeddings(store, llm, texts, purpose)
    record(store, call)
    return vectors, vector_model(call)


def call_embeddings(
    store: SearchStore, llm: LLMClient, texts: list[str], purpose: str
) -> tuple[list[list[float]], LLMCallRecord]:
    """(the vectors, the answered call's record, for the caller to store). The tries the gateway
    retried before, and a failed call, are recorded here (the failure then raised); the caller checks
    the vectors (``vectors_problem``)."""
    started = time.perf_counter()
    try:
        response, tried = embed_with_tries(llm, texts, purpose)
    except (BudgetExhaustedError, NoEmbeddingsError):
        raise  # refused before any request: nothing to record (a row per refused search, 60 a minute a key)
    except CallDeadlineError as exc:  # between two tries: each try made is a call; no call more
        record_tries(store, purpose, llm, exc.attempts)
        raise
    except Exception as exc:
        record_tries(store, purpose, llm, getattr(exc, "attempts", ())[:-1])
        record_failure(store, purpose, llm, exc, started)
        raise
    record_tries(store, purpose, llm, tried)
    return response.vectors, answered(purpose, response, "ok")
