"""The only writer of llm_calls rows and of each day's spend: every purpose costed here, at one price list."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import BigInteger, ColumnElement, any_, bindparam, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from models.bulk import BulkInsert
from models.tables import JOBS, LLM_CALLS
from worker.accounting.budget import SEARCH_PURPOSES, SEARCH_SCOPE, WORK_SCOPE
from worker.accounting.prices import PRICES, PRICES_KEY, Price, cost_usd, parse_prices, price_of
from worker.core.erasure import is_erased_name
from worker.core.errors import loggable
from worker.core.jsonvalues import made_storable
from worker.llm.retry import AttemptRecord
from worker.llm.types import Usage

logger = logging.getLogger(__name__)

SIMULATOR_PROVIDER = "simulator"  # the bundled stand-in: unpriced on purpose (its calls cost nothing)

_COLUMNS = (
    "job_id",
    "provider",
    "model",
    "purpose",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "latency_ms",
    "outcome",
    "cost_usd",
    "batch",
    "error",
)
_SCOPE = "CASE WHEN purpose IN ({}) THEN '{}' ELSE '{}' END".format(
    ", ".join(f"'{purpose}'" for purpose in SEARCH_PURPOSES), SEARCH_SCOPE, WORK_SCOPE
)
# The calls, and their cost added to their day's spend, in one statement (one round trip). The day is
# the call's created_at in UTC (now(): the transaction's start), the day budget's clock. Each backend
# adds to a row of its own, so concurrent commits never wait on each other's spend.
_INSERT = BulkInsert(
    LLM_CALLS,
    _COLUMNS,
    returning="id, purpose, cost_usd, created_at",
    around=f"""
    WITH calls AS ({{insert}}),
    spend AS (
        INSERT INTO llm_spend_days AS d (day, scope, backend, cost_usd)
        SELECT (created_at AT TIME ZONE 'UTC')::date, {_SCOPE}, pg_backend_pid(), sum(cost_usd)
        FROM calls WHERE cost_usd > 0 GROUP BY 1, 2
        ON CONFLICT (day, scope, backend) DO UPDATE SET cost_usd = d.cost_usd + EXCLUDED.cost_usd
    )
    SELECT id FROM calls
    """,
)


@dataclass(frozen=True)
class LLMCallRecord:
    """One try of one LLM call, as the llm_calls table keeps it."""

    purpose: str
    provider: str
    model: str
    usage: Usage | None
    latency_ms: int
    outcome: str
    job_id: int | None = None
    error: str | None = None
    batch: bool = False  # billed through a provider batch (half price)

    @classmethod
    def failed(
        cls,
        purpose: str,
        llm: object,
        exc: BaseException,
        latency_ms: int,
        job_id: int | None = None,
        *,
        words: bool = True,
    ) -> LLMCallRecord:
        """The record of a call through ``llm`` that raised ``exc``: what a reply the provider answered
        but that could not be used billed (``LLMError.usage``), priced as the model that answered it.
        ``words`` False: the error's status and code only (``loggable``), for a call no erasure could
        find (a provider's message may quote its input: facts of many pages, a transcript under no job)."""
        provider, model = getattr(exc, "answered_by", None) or (
            getattr(llm, "provider", "unknown"),
            getattr(llm, "model", "unknown"),
        )
        outcome = getattr(exc, "outcome", "provider_error")
        usage = getattr(exc, "usage", None)
        # Uncut: a provider's words are already kept to MAX_PROVIDER_MESSAGE_CHARS (worker.llm.errors), as
        # extraction's rows keep them; cut again to 500 here, three purposes' rows kept half of it.
        return cls(
            purpose, provider, model, usage, latency_ms, outcome, job_id, str(exc) if words else loggable(exc)
        )

    @classmethod
    def failed_tries(
        cls,
        purpose: str,
        llm: object,
        tries: Iterable[AttemptRecord],
        job_id: int | None = None,
        *,
        words: bool = True,
    ) -> list[LLMCallRecord]:
        """The records of the retry layer's failed tries of one call: each cost a request and is a
        call of its own (``words``: as ``failed``)."""
        return [
            cls.failed(purpose, llm, t.error, t.latency_ms, job_id, words=words)
            for t in tries
            if t.error is not None
        ]


def kept_error(call: LLMCallRecord) -> str | None:
    """What the ledger keeps of a call's error. A refusal's "reason" is the model's own words, often
    quoting the page or beginning the summary; llm_calls rows outlive the erasure of what they were
    about, so they keep how long the words were (the words themselves stay in the segment's audit row
    or the compaction's attempt log, erased with the page or the transcript)."""
    if call.error is None:
        return None
    if call.outcome == "refusal":
        return f"the model refused ({len(call.error)} characters of reply, kept with what it was about)"
    return made_storable(call.error)


# What an erasure leaves of a provider's message on the calls of the erased page's or transcript's jobs.
ERASED_CALL_ERROR = "the provider's message went with the erasure of what the call was about"


def forget_call_errors(session: Session, kind: str, subject: str) -> None:
    """In the caller's transaction (an erasure's, after it renamed the jobs' subject): the provider's
    words leave the llm_calls rows of the jobs of ``kind`` on ``subject``. A provider's error message may
    quote the request (page text, a transcript); the rows outlive the erasure, and a refusal's already
    keeps only its length (``kept_error``). A call still in flight is recorded without them (``record``)."""
    jobs = select(JOBS.c.id).where(JOBS.c.kind == kind, JOBS.c.subject == subject)
    forget_errors_of(session, LLM_CALLS.c.job_id.in_(jobs))


def forget_errors_of(session: Session, calls: ColumnElement[bool]) -> None:
    """In the caller's transaction: the provider's words leave the llm_calls rows ``calls`` selects
    (``forget_call_errors``; an erasure also names the calls its page's audit rows or its transcript's
    compactions recorded, which a CLI run or a backfill made under no job of the page's)."""
    session.execute(
        update(LLM_CALLS)
        .where(calls, LLM_CALLS.c.error.is_not(None), LLM_CALLS.c.outcome != "refusal")
        .values(error=ERASED_CALL_ERROR)
    )


# The jobs of failed calls with their subjects, as committed. Not locked: FOR SHARE, held to the end of
# the recording transaction (a whole-page swap records first), kept the job's heartbeat from writing and
# lost the run its lease. A call recorded while an erasure's own transaction is open can still keep its
# message (a window of that transaction's length).
_JOB_SUBJECTS = select(JOBS.c.id, JOBS.c.subject).where(
    JOBS.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger)))
)


def _erased_jobs(session: Session, calls: Sequence[LLMCallRecord]) -> set[int]:
    """The jobs of these calls whose page or transcript was erased (their subject renamed): a failed call
    in flight through the erasure is recorded after it, and its provider message may quote the request."""
    ids = {c.job_id for c in calls if c.job_id is not None and c.error is not None and c.outcome != "refusal"}
    if not ids:
        return set()
    rows = session.execute(_JOB_SUBJECTS, {"ids": sorted(ids)}).all()
    return {job_id for job_id, subject in rows if is_erased_name(subject)}


class Ledger:
    """Costs and records LLM calls; the price table is the list prices plus the live `llm.prices`."""

    def __init__(self, get_config: Callable[[str], str | None]) -> None:
        self._get = get_config
        # The override last read and the table it gave: parsed once per value, not once per call.
        self._parsed: tuple[str | None, dict[str, Price]] = (None, dict(PRICES))
        self._unpriced_seen: set[str] = set()

    def prices(self) -> dict[str, Price]:
        value = self._get(PRICES_KEY)
        last, table = self._parsed
        if value == last:
            return table
        try:
            table = {**PRICES, **parse_prices(value)}
        except ValueError as exc:
            # `config set` refuses a bad override, but one stored before a rule was added can be read
            # here: say so once (never fail a call over it), since it costs calls at the list prices.
            logger.warning(
                "%s is not used (%s); calls are costed at the built-in list prices until it is set again",
                PRICES_KEY,
                exc,
            )
            table = dict(PRICES)
        self._parsed = (value, table)
        return table

    def cost(self, call: LLMCallRecord, prices: dict[str, Price] | None = None) -> Decimal:
        if call.usage is None:
            return Decimal(0)
        table = prices if prices is not None else self.prices()
        if call.provider != SIMULATOR_PROVIDER and price_of(call.model, table) is None:
            self._unpriced(call)
        return cost_usd(call.model, call.usage, table, batch=call.batch)

    def _unpriced(self, call: LLMCallRecord) -> None:
        """Said once per model and process: a model the list prices do not know (a newer release, an
        OpenAI-compatible server's) was costed $0 without a word, so no budget ever counted its calls."""
        if call.model in self._unpriced_seen or (
            call.usage is not None and call.usage.input_tokens + call.usage.output_tokens == 0
        ):
            return
        self._unpriced_seen.add(call.model)
        logger.warning(
            "no price for model %s: its calls are recorded at $0 and no budget counts them; set %s "
            '(e.g. {"%s": {"input": 0.15, "output": 0.6}}, USD per 1M tokens; 0 for a free model)',
            call.model,
            PRICES_KEY,
            call.model,
        )

    def row(
        self, call: LLMCallRecord, prices: dict[str, Price] | None = None, *, erased: bool = False
    ) -> dict[str, object]:
        """The llm_calls row of a call; ``erased``: its job's page or transcript is gone (no provider
        message kept)."""
        usage = call.usage or Usage()
        return {
            "job_id": call.job_id,
            "provider": call.provider,
            "model": call.model,
            "purpose": call.purpose,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "latency_ms": call.latency_ms,
            "outcome": call.outcome,
            "cost_usd": self.cost(call, prices),
            "batch": call.batch,
            # (a refusal keeps its length only, as on every path: no provider message to take out)
            "error": ERASED_CALL_ERROR
            if erased and call.error is not None and call.outcome != "refusal"
            else kept_error(call),
        }

    def record(self, session: Session, call: LLMCallRecord) -> int:
        """Insert one llm_calls row in the caller's transaction; returns its id."""
        return self.record_many(session, [call])[0]

    def record_many(
        self, session: Session, calls: Sequence[LLMCallRecord], *, erased: bool = False
    ) -> list[int]:
        """Insert the rows in one statement, in the caller's transaction; ids in the same order.
        ``erased``: what the calls were about is gone (a page erased under the run), so no provider
        message is kept; nor is one of a call whose job's name an erasure took."""
        if not calls:
            return []
        prices = self.prices()
        gone = _erased_jobs(session, calls)
        return _INSERT.new_keys(
            session, [self.row(c, prices, erased=erased or c.job_id in gone) for c in calls]
        )
