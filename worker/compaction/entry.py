"""compact_transcript: one compaction from a sessionmaker, for the CLI, the benchmarks and tests."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Ledger
from worker.calibration import ActiveThreshold
from worker.compaction.service import CompactionOutcome, compact
from worker.compaction.store import TranscriptStore
from worker.config_store import ConfigReader
from worker.llm.types import LLMClient


def compact_transcript(
    factory: sessionmaker[Session],
    llm: LLMClient,
    transcript_id: str,
    *,
    threshold: Callable[[], ActiveThreshold],
    force: bool = False,
    job_id: int | None = None,
    guard: Callable[[], None] | None = None,
    enabled: Callable[[], bool] | None = None,
    max_output_tokens: int = 4096,
    intent_messages: int = 3,
    ledger: Ledger | None = None,
) -> CompactionOutcome:
    """``worker.compaction.service.compact`` over a TranscriptStore built on ``factory``.

    ``ledger`` costs the llm_calls rows (a runtime passes ``rt.ledger``); without one, a Ledger reads
    the ``llm.prices`` override fresh from this factory's config table, so the override always applies.
    """
    store = TranscriptStore(
        factory, ledger if ledger is not None else Ledger(ConfigReader(factory, ttl=0).get)
    )
    return compact(
        store,
        llm,
        transcript_id,
        threshold=threshold,
        force=force,
        job_id=job_id,
        guard=guard,
        enabled=enabled,
        max_output_tokens=max_output_tokens,
        intent_messages=intent_messages,
    )
