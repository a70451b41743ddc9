"""What stands for an erased name (a page's slug, a transcript's id, an entity's key): a digest of it.

A name can itself name a person ("therapy/alice", "support-chat-alice", "people/alice-example"), so an
erasure keeps only the sha256 of its parts joined by '|': enough to answer "was this erased?" for a
name one already knows, not to list what was erased. One rule for every erasure.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

from worker.core.consolidation import PAGE_KEY_PREFIX

ERASED_PREFIX = "erased:"
# An erased name where a record still names it: ``erased:<sha256>`` alone (a transcript's jobs) or after
# a source (``<source>|erased:<sha256>``, a page's, or an entity's key; ``<source>|page:erased:<sha256>``,
# the key of a page's facts that name no entity).
_ERASED_NAME = re.compile(
    r"(?:^|.*\|)(?:" + re.escape(PAGE_KEY_PREFIX) + r")?" + re.escape(ERASED_PREFIX) + r"[0-9a-f]{64}",
    re.DOTALL,
)


def erased_digest(*parts: str) -> str:
    """The hex sha256 of ``parts`` joined by '|' (``source_id|slug`` for a page, the id of a transcript)."""
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def erased_label(*parts: str) -> str:
    """``erased:<digest>``: what an erased name becomes where a record must still name something."""
    return ERASED_PREFIX + erased_digest(*parts)


def is_erased_name(name: str) -> bool:
    """Whether ``name`` (a job's subject) is what an erasure left of a name: a live transcript's id may
    hold "erased:" itself."""
    return _ERASED_NAME.fullmatch(name) is not None


def nothing_to_erase(missing: str, erased_at: datetime | None) -> str:
    """What an erasure that found nothing says: ``missing`` ("no page 'x' in source 'y'"), and when the
    name was erased before (a retried erasure whose first answer was lost was told the page never was)."""
    if erased_at is None:
        return missing
    return f"{missing} (it was erased at {erased_at.isoformat(timespec='seconds')})"


__all__ = ["ERASED_PREFIX", "erased_digest", "erased_label", "is_erased_name", "nothing_to_erase"]
