"""The config table: kill switches and tunables, read by workers through a short cache."""

from __future__ import annotations

import difflib
import re
import time
from collections.abc import Callable, Iterable

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from models import ConfigEntry
from models.reads import read_only
from worker.accounting import BUDGET_KEYS, PRICES_KEY, validate_config_value
from worker.core.conversation import check_page_types
from worker.core.facts import MAX_FACTS_LIMIT
from worker.core.ttl_cache import TtlCache

EXTRACTION_ENABLED = "facts.extraction_enabled"
COMPACTION_ENABLED = "compaction.enabled"
CALIBRATION_ENABLED = "calibration.enabled"
CONSOLIDATION_ENABLED = "consolidation.enabled"
# Off, every summary that makes the context smaller is applied, whatever its coverage (seed 002's
# quality_gate = false: the token gate alone); on by default.
COMPACTION_QUALITY_GATE = "compaction.quality_gate"
EXTRACTION_PAGE_TYPES = "extraction.page_types"
EXTRACTION_MAX_FACTS = "extraction.max_facts"
# How many permanent failures (across attempts and runs) skip a poison segment.
EXTRACTION_MAX_SEGMENT_FAILURES = "extraction.max_segment_failures"
MAX_SEGMENT_FAILURES_CEILING = 100
# The count settings and their ceilings (from 1): one rule for the writer and the readers (stored_count).
COUNTS = {
    EXTRACTION_MAX_FACTS: MAX_FACTS_LIMIT,
    EXTRACTION_MAX_SEGMENT_FAILURES: MAX_SEGMENT_FAILURES_CEILING,
}

KILL_SWITCHES = (EXTRACTION_ENABLED, COMPACTION_ENABLED, CALIBRATION_ENABLED, CONSOLIDATION_ENABLED)
TUNABLES = (
    EXTRACTION_PAGE_TYPES,
    EXTRACTION_MAX_FACTS,
    EXTRACTION_MAX_SEGMENT_FAILURES,
    COMPACTION_QUALITY_GATE,
)
SWITCHES = (*KILL_SWITCHES, COMPACTION_QUALITY_GATE)  # true/false values; a missing one means on
# Every key something reads. Setting another is refused: `facts.extraction_enable false` stored
# quietly would leave an operator sure the extraction is off while every worker carries on.
CONFIG_KEYS = (*KILL_SWITCHES, *TUNABLES, *BUDGET_KEYS, PRICES_KEY)
DISABLED_VALUES = frozenset({"false", "0", "no", "off"})
ENABLED_VALUES = frozenset({"true", "1", "yes", "on"})


def is_enabled(value: str | None) -> bool:
    """A missing switch means enabled; false/0/no/off (any case, any padding) means disabled."""
    return value is None or value.strip().lower() not in DISABLED_VALUES


class UnknownConfigKeyError(ValueError):
    """A key no part of Factmill reads (a typo, most likely)."""


def _words(key: str) -> set[str]:
    return set(re.split(r"[._]", key.lower()))


_KNOWN_WORDS = frozenset().union(*map(_words, CONFIG_KEYS))


def _keeps_words(typed: str, known: str) -> bool:
    """Whether ``known`` has every word of ``typed`` that some key has (a misspelt word is free): the
    closest spelling alone offered `facts.extraction_enabled` for `facts.compaction_enabled`, and the
    work budget for a search budget; an operator who took the hint switched off the wrong thing."""
    return _words(typed) & _KNOWN_WORDS <= _words(known)


def check_key(key: str) -> None:
    """Raise UnknownConfigKeyError, naming the closest known key, unless ``key`` is one of CONFIG_KEYS."""
    if key in CONFIG_KEYS:
        return
    close = [known for known in difflib.get_close_matches(key, CONFIG_KEYS, n=5) if _keeps_words(key, known)]
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise UnknownConfigKeyError(f"unknown config key {key!r}{hint} The keys are: {', '.join(CONFIG_KEYS)}")


def validate_value(key: str, value: str) -> str:
    """Reject unknown keys and values that would silently mean something else; returns the value to
    store."""
    check_key(key)
    cleaned = value.strip()
    if not cleaned:  # read as the default: an empty budget lifted the cap (and woke its paused jobs)
        raise ValueError(
            f"{key} needs a value; to return it to its default, unset it "
            f"(DELETE /v1/config/{key}, or `factmill config unset {key}`)"
        )
    if key in SWITCHES and cleaned.lower() not in DISABLED_VALUES | ENABLED_VALUES:
        raise ValueError(f"{key} must be one of true/false/1/0/yes/no/on/off, got {value!r}")
    for counted, ceiling in COUNTS.items():
        if key == counted and stored_count(cleaned, ceiling) is None:
            raise ValueError(f"{key} must be an integer from 1 to {ceiling}, got {value!r}")
    if key == EXTRACTION_PAGE_TYPES:
        check_page_types(cleaned)
    validate_config_value(key, cleaned)
    return cleaned


def stored_count(value: str | None, ceiling: int) -> int | None:
    """A count setting's value as the writer and every reader take it: ASCII digits (``"²".isdigit()``
    is true, and ``int("²")`` raised in the extraction job that read it), 1 to ``ceiling``; else None
    (a reader then uses its default)."""
    text = (value or "").strip()
    # Read without its leading zeros (which the writer always took), and its length checked first:
    # int() refuses past 4,300 digits, zeros included, which a hand-written row may hold.
    digits = text.lstrip("0")
    if not (text.isascii() and text.isdigit()) or len(digits) > len(str(ceiling)):
        return None
    count = int(digits or "0")
    return count if 1 <= count <= ceiling else None


def get_config(session: Session, key: str) -> str | None:
    return session.scalar(select(ConfigEntry.value).where(ConfigEntry.key == key))


def set_config(session: Session, key: str, value: str, updated_by: str | None = None) -> str:
    cleaned = validate_value(key, value)
    stmt = insert(ConfigEntry).values(key=key, value=cleaned, updated_by=updated_by)
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[ConfigEntry.key],
            set_={
                "value": stmt.excluded.value,
                "updated_by": stmt.excluded.updated_by,
                "updated_at": stmt.excluded.updated_at,
            },
        )
    )
    return cleaned


def unset_config(session: Session, key: str) -> bool:
    """Remove ``key``, so it means its default again (a kill switch: enabled; a budget: none); returns
    whether it was set. A key nothing reads may be removed only if it is set (a row kept from before
    keys were checked); otherwise it is refused like any unknown key."""
    removed = session.execute(delete(ConfigEntry).where(ConfigEntry.key == key).returning(ConfigEntry.key))
    if removed.first() is not None:
        return True
    check_key(key)
    return False


def unread_keys(entries: Iterable[ConfigEntry]) -> list[str]:
    """The keys among ``entries`` that nothing reads (set before keys were checked)."""
    return [entry.key for entry in entries if entry.key not in CONFIG_KEYS]


def list_config(session: Session) -> list[ConfigEntry]:
    return list(session.scalars(select(ConfigEntry).order_by(ConfigEntry.key)))


def config_table(session: Session) -> tuple[list[tuple[str, ConfigEntry | None]], list[str]]:
    """What `config list` and GET /v1/config show: every key something reads, in CONFIG_KEYS' order,
    with its row (None: never set, its default), then each set key nothing reads; and those keys."""
    entries = {entry.key: entry for entry in list_config(session)}
    unread = unread_keys(entries.values())
    return [(key, entries.get(key)) for key in (*CONFIG_KEYS, *unread)], unread


class ConfigReader:
    """Reads config keys through a cache at most ``ttl`` seconds old (0 = always fresh).

    Workers consult kill switches before every LLM call, from many threads; the cache keeps that to
    one query per key per ``ttl`` (``TtlCache``: threads that find a key expired while it is being
    read take its previous value) while still making a flipped switch take effect within ``ttl``
    and one query.
    """

    def __init__(
        self, factory: sessionmaker[Session], ttl: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._factory = factory
        self._cache: TtlCache[str, str | None] = TtlCache(self._read, ttl, clock)

    def get(self, key: str, *, fresh: bool = False) -> str | None:
        return self.fresh(key) if fresh else self._cache.get(key)

    def fresh(self, key: str) -> str | None:
        """``key`` read now, past the cache (and kept in it)."""
        return self._cache.load(key)

    def _read(self, key: str) -> str | None:
        with read_only(self._factory) as session:
            return get_config(session, key)

    def enabled(self, key: str) -> bool:
        """A switch's state. "Off" is always confirmed against the table, so a switch turned back on is
        seen at once (resumed jobs are not paused again by a stale cache); "on" may be ``ttl`` old."""
        return is_enabled(self.get(key)) or is_enabled(self.get(key, fresh=True))
