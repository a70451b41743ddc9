"""LLM spending limits per day and per job, read live from the config table, checked before each call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation

from sqlalchemy import BigInteger, Date, any_, bindparam, cast, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session, sessionmaker

from models import Job, LLMCall, LLMSpendDay
from models.llm_call import counts_for_job_budget
from models.reads import read_only
from worker.core.ttl_cache import TtlCache
from worker.llm.errors import BudgetExhaustedError

logger = logging.getLogger(__name__)
_SAID_UNREADABLE: set[tuple[str, str]] = set()  # said once a process: each check reads it

DAILY_BUDGET_KEY = "llm.budget_daily_usd"
JOB_BUDGET_KEY = "llm.budget_job_usd"
# Readers' LLM use (query expansion, HyDE and query embeddings) has its own day budget, so searches can
# never pause extraction and a busy extraction day never blocks search.
SEARCH_DAILY_BUDGET_KEY = "llm.budget_search_daily_usd"
BUDGET_KEYS = (DAILY_BUDGET_KEY, JOB_BUDGET_KEY, SEARCH_DAILY_BUDGET_KEY)
# = worker.search's EXPANSION_PURPOSE and EMBEDDING_PURPOSE (tests/integration/test_access_budget.py)
SEARCH_PURPOSES = ("search_expansion", "search_embedding")
# The two day budgets' scopes, as llm_spend_days keeps them (the ledger sorts each call into one).
WORK_SCOPE, SEARCH_SCOPE = "work", "search"
_SPENT_TODAY = select(func.coalesce(func.sum(LLMSpendDay.cost_usd), 0)).where(
    LLMSpendDay.day == cast(func.timezone("UTC", func.now()), Date),
    LLMSpendDay.scope == bindparam("b_scope"),
)


# The most a budget may say: what an llm_calls cost (numeric(18,6)) can hold. A larger one (1e1000000)
# was stored, and the first subtraction from it overflowed Decimal's context inside a backfill's pass.
MAX_BUDGET_USD = Decimal(10**12)


def parse_usd(value: str | None) -> Decimal | None:
    """A budget value: a number of dollars from 0 to MAX_BUDGET_USD; None/empty means no limit."""
    if value is None or not value.strip():
        return None
    try:
        amount = Decimal(value.strip())
    except InvalidOperation as exc:
        raise ValueError(
            f"a budget must be a number of US dollars such as 25 or 2.50, got {value!r}"
        ) from exc
    if not amount.is_finite() or not 0 <= amount <= MAX_BUDGET_USD:
        raise ValueError(
            f"a budget must be a number of US dollars from 0 to {MAX_BUDGET_USD:,}, "
            f"got {value.strip()[:40]!r} (leave it unset for no limit)"
        )
    return amount


# Which of a job's calls count against its own budget: models.llm_call.counts_for_job_budget.
COUNTS_FOR_JOB_BUDGET = counts_for_job_budget()


# The share of a day budget past which its spend is read fresh at every check.
NEAR_LIMIT = Decimal("0.9")
# How long a spent budget's limit, read past the config cache before a call is refused, is trusted.
RECHECK_SECONDS = 0.25


class Budget:
    """Checks spend (from llm_calls) against the live budgets before each call.

    The day total is cached for ``ttl`` seconds, so a check costs one query per ttl (a refused one, a
    read of its limit per RECHECK_SECONDS too); within
    NEAR_LIMIT of the limit it is read fresh at each check (cached, the calls a second's worth of
    checks let through all went past a spent budget). Concurrent calls may overshoot a budget by the
    calls in flight and the paid results not yet committed. One per process: every client and runner
    shares its cache.
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        get_config: Callable[[str], str | None],
        ttl: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        search: bool = False,
        fresh_config: Callable[[str], str | None] | None = None,
    ) -> None:
        """``search``: the readers' budget (search purposes against SEARCH_DAILY_BUDGET_KEY); else the
        work budget (every other purpose against the day and job budgets). ``fresh_config`` reads a
        key past ``get_config``'s cache: a spent budget's limit is read again through it before a call
        is refused (raised, it woke the paused jobs, which a cache still holding the old limit paused
        again until the next sweep)."""
        self._factory, self._get = factory, get_config
        # Shared by the threads for a moment: a day spent (a search budget set to 0 on purpose) made
        # every refused check read the config table past the cache, two per search.
        recheck = TtlCache(fresh_config, RECHECK_SECONDS, clock) if fresh_config is not None else None
        self._fresh_get = recheck.get if recheck is not None else None
        self._search = search
        self._daily_key = SEARCH_DAILY_BUDGET_KEY if search else DAILY_BUDGET_KEY
        self._day: TtlCache[None, Decimal] = TtlCache(self._spent_since_midnight, ttl, clock)

    def spent_today(self) -> Decimal:
        return self._day.get(None)

    def _spent_since_midnight(self, _: None) -> Decimal:
        """The scope's spend since UTC midnight (by the database's clock, as the ledger dates calls)."""
        scope = SEARCH_SCOPE if self._search else WORK_SCOPE
        with read_only(self._factory) as session:
            spent = session.scalar(_SPENT_TODAY, {"b_scope": scope})
        return Decimal(spent or 0)

    def spent_by_job(self, job_id: int) -> Decimal:
        """The job's spend against its own budget: its calls since its budgets last started over."""
        with read_only(self._factory) as session:
            spent = session.scalar(
                select(func.coalesce(func.sum(LLMCall.cost_usd), 0))
                .join(Job, Job.id == LLMCall.job_id)
                .where(LLMCall.job_id == job_id, COUNTS_FOR_JOB_BUDGET)
            )
        return Decimal(spent or 0)

    def check(self, job_id: int | None = None) -> None:
        """Raise BudgetExhaustedError if the day's (or this job's) budget is spent."""
        daily = self._limit(self._daily_key)
        if daily is not None:
            spent = self.spent_today()
            if daily * NEAR_LIMIT <= spent < daily:
                spent = self._day.load(None)  # close to it: the cached total may be a second behind
            if spent >= daily and self._fresh_get is not None:
                daily = self._limit(self._daily_key, self._fresh_get)
            if daily is not None and spent >= daily:
                scope = "search day" if self._search else "day"
                raise BudgetExhaustedError(scope, daily, spent, key=self._daily_key)
        per_job = self._limit(JOB_BUDGET_KEY)
        if per_job is not None and job_id is not None:
            spent = self.spent_by_job(job_id)
            if spent >= per_job and self._fresh_get is not None:
                per_job = self._limit(JOB_BUDGET_KEY, self._fresh_get)
            if per_job is not None and spent >= per_job:
                raise BudgetExhaustedError("job", per_job, spent, key=JOB_BUDGET_KEY)

    def room(self, job_id: int | None = None) -> tuple[Decimal | None, Decimal | None]:
        """What is left of the day's and of this job's budgets (None: no limit), never below 0."""
        daily, per_job = self._limit(self._daily_key), self._limit(JOB_BUDGET_KEY)
        day_left = None if daily is None else max(Decimal(0), daily - self.spent_today())
        job_left = None
        if per_job is not None and job_id is not None:
            job_left = max(Decimal(0), per_job - self.spent_by_job(job_id))
        return day_left, job_left

    def jobs_with_room(self, job_ids: Sequence[int]) -> list[int]:
        """Of these jobs, those both budgets would let call now (one query for the jobs' spend):
        what wakes jobs paused for budget, so one whose own budget is spent stays asleep."""
        if not job_ids or not self.has_room():
            return []
        per_job = self._limit(JOB_BUDGET_KEY)
        if per_job is None:
            return list(job_ids)
        with read_only(self._factory) as session:
            spent = dict(
                session.execute(
                    select(LLMCall.job_id, func.sum(LLMCall.cost_usd))
                    .join(Job, Job.id == LLMCall.job_id)
                    .where(
                        LLMCall.job_id == any_(bindparam("ids", list(job_ids), type_=ARRAY(BigInteger))),
                        COUNTS_FOR_JOB_BUDGET,
                    )
                    .group_by(LLMCall.job_id)
                ).all()
            )  # one array parameter: 65,536 waiters or more in an IN list failed every sweep
        return [job_id for job_id in job_ids if Decimal(spent.get(job_id) or 0) < per_job]

    def has_room(self, job_id: int | None = None) -> bool:
        try:
            self.check(job_id)
        except BudgetExhaustedError:
            return False
        return True

    def _limit(self, key: str, get: Callable[[str], str | None] | None = None) -> Decimal | None:
        """The budget ``key`` sets (read through ``get``, else the cached reader). A stored value it
        refuses (written before the rules, or by hand) was read as no limit, unsaid: a huge one stands for
        MAX_BUDGET_USD, any other for 0 (spent), said in the log, as the check's refusal says which key
        to fix."""
        value = (get or self._get)(key)
        try:
            return parse_usd(value)
        except ValueError:
            try:
                huge = value is not None and Decimal(value.strip()) > MAX_BUDGET_USD
            except InvalidOperation:
                huge = False
            if huge:
                return MAX_BUDGET_USD
            if (key, str(value)) not in _SAID_UNREADABLE:
                _SAID_UNREADABLE.add((key, str(value)))
                logger.warning(
                    "config %s holds a value no budget takes; read as 0 until it is set again", key
                )
            return Decimal(0)
