"""Which facts a reader sees: current ones by default, the whole chain with include_history, or what
was true at a moment (as_of). One clause, used by search, the facts routes, MCP and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from worker.core.moments import as_utc

# {a} is the facts table's alias. A duplicate never answers: the fact it repeats does; an undated fact
# begins when it was stored until it is consolidated, which dates it by when it was said
# (worker.consolidation.decisions.write_decision). The same rule as worker.core.consolidation.true_at
# (tests/integration/test_fact_history.py runs both over the same rows).
CURRENT_SQL = "{a}.status = 'current'"
AS_OF_SQL = (
    "{a}.status <> 'duplicate' AND COALESCE({a}.valid_from, {a}.created_at) <= :lifecycle_as_of "
    "AND ({a}.valid_to IS NULL OR {a}.valid_to > :lifecycle_as_of)"
)


@dataclass(frozen=True)
class Lifecycle:
    """How much of the facts' history a read wants."""

    include_history: bool = False
    as_of: datetime | None = None

    def __post_init__(self) -> None:
        if self.as_of is not None:
            object.__setattr__(self, "as_of", as_utc(self.as_of))

    def clause(self, alias: str = "facts") -> tuple[str | None, dict[str, Any]]:
        """(SQL for the facts' WHERE, its parameters); None: every fact (the history)."""
        if self.as_of is not None:
            return AS_OF_SQL.format(a=alias), {"lifecycle_as_of": self.as_of}
        if self.include_history:
            return None, {}
        return CURRENT_SQL.format(a=alias), {}


CURRENT_ONLY = Lifecycle()

__all__ = ["AS_OF_SQL", "CURRENT_ONLY", "CURRENT_SQL", "Lifecycle"]
