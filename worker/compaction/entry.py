"""compact_transcript: one compaction from a sessionmaker, for the CLI, the benchmarks and tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

from sqlalchemy.orm import Session, sessionmaker

from worker.accounting import Ledger
from worker.calibration import ActiveThreshold
from worker.compaction.outcome import CompactionOutcome
from worker.compaction.service import CompactOptions, compact
from worker.compaction.store import TranscriptStore
from worker.config_store import COMPACTION_QUALITY_GATE, ConfigReader
from worker.llm.types import LLMClient


def compact_transcript(
    factory: sessionmaker[Session],
    llm: LLMClient,
    transcript_id: str,
    *,
    threshold: Callable[[], ActiveThreshold],
    ledger: Ledger | None = None,
    **options: Unpack[CompactOptions],
) -> CompactionOutcome:
    """``worker.compaction.service.compact`` over a TranscriptStore built on ``factory``.

    ``ledger`` costs the llm_calls rows (a runtime passes ``rt.ledger``); without one, a Ledger reads
    the ``llm.prices`` override fresh from this factory's config table, so the override always applies.
    The quality gate's switch (``compaction.quality_gate``) is read there too, unless ``options`` say.
    """
    config = ConfigReader(factory, ttl=0)
    store = TranscriptStore(factory, ledger if ledger is not None else Ledger(config.get))
    options.setdefault("quality_gate", config.enabled(COMPACTION_QUALITY_GATE))
    return compact(store, llm, transcript_id, threshold=threshold, **options)
