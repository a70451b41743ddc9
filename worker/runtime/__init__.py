"""Per-process resources a worker (or the API, or the CLI) shares: settings, sessions, config, the
ledger and budget, and the one LLM client."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.accounting import Budget, Ledger
from worker.config_store import ConfigReader
from worker.embedded import EmbeddedUnavailableError, embedded_redis_url
from worker.llm.gateway import describe, open_llm_client
from worker.llm.pipe import FollowUps, LLMPipe
from worker.llm.types import LLMClient
from worker.runtime import tracing
from worker.runtime.page_memory import PageMemory
from worker.settings import Settings, get_settings

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    factory: sessionmaker[Session]
    config: ConfigReader
    _llm: LLMClient | None = None
    _ledger: Ledger | None = None
    _budget: Budget | None = None
    _search_budget: Budget | None = None
    _search_llm: LLMClient | None = None
    _llm_pipe: LLMPipe | None = None
    _page_memory: PageMemory | None = None
    _follow_ups: FollowUps | None = None
    _limits_settings: Settings | None = None
    _llm_stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def limits_settings(self, *, limited: bool) -> Settings:
        """The settings a rate limit is built from (``limited``: that limit is on): with no Redis named,
        the embedded one, shared by every process on this data folder, as a broker's Redis would be."""
        if not limited:
            return self.settings
        if self._limits_settings is None:
            self._limits_settings = shared_limits(self.settings)
        return self._limits_settings

    def _gateway_settings(self) -> Settings:
        return self.limits_settings(limited=bool(self.settings.llm_rpm or self.settings.llm_tpm))

    @property
    def ledger(self) -> Ledger:
        """The one writer of llm_calls rows for this process (prices read live from `llm.prices`)."""
        if self._ledger is None:
            self._ledger = Ledger(self.config.get)
        return self._ledger

    @property
    def budget(self) -> Budget:
        """The one budget for this process: every client and runner shares its cache."""
        if self._budget is None:
            self._budget = Budget(self.factory, self.config.get, fresh_config=self.config.fresh)
        return self._budget

    @property
    def search_budget(self) -> Budget:
        """The readers' budget (llm.budget_search_daily_usd), apart from the work budget."""
        if self._search_budget is None:
            self._search_budget = Budget(
                self.factory, self.config.get, search=True, fresh_config=self.config.fresh
            )
        return self._search_budget

    @property
    def search_llm(self) -> LLMClient:
        """The LLM client searches use: the same gateway, checked against the readers' budget."""
        if self._search_llm is None:
            with self._lock:
                if self._search_llm is None:
                    self._search_llm = self._llm_stack.enter_context(
                        open_llm_client(self._gateway_settings(), budget=self.search_budget)
                    )
        return self._search_llm

    @property
    def llm(self) -> LLMClient:
        """The configured LLM client (budgeted), opened on first use and kept for the life of the process."""
        if self._llm is None:
            with self._lock:
                if self._llm is None:
                    self._llm = self._llm_stack.enter_context(
                        open_llm_client(self._gateway_settings(), budget=self.budget)
                    )
                    logger.info(describe(self.settings))
        return self._llm

    @property
    def llm_pipe(self) -> LLMPipe:
        """The process's LLM pipe: FACTMILL_LLM_CONCURRENCY calls in flight, shared by every job."""
        if self._llm_pipe is None:
            with self._lock:
                if self._llm_pipe is None:
                    self._llm_pipe = LLMPipe(self.settings.llm_concurrency)
        return self._llm_pipe

    @property
    def page_memory(self) -> PageMemory:
        """The page text this process's jobs hold parsed at once (FACTMILL_EXTRACTION_PAGE_BYTES_HELD)."""
        if self._page_memory is None:
            with self._lock:
                if self._page_memory is None:
                    self._page_memory = PageMemory(self.settings.extraction_page_bytes_held)
        return self._page_memory

    @property
    def follow_ups(self) -> FollowUps:
        """Work that follows a job's commits without holding its slot (embedding new facts)."""
        if self._follow_ups is None:
            with self._lock:
                if self._follow_ups is None:
                    self._follow_ups = FollowUps(self.settings.follow_up_threads, name="follow-up")
        return self._follow_ups

    def close(self) -> None:
        if self._follow_ups is not None:
            self._follow_ups.close()  # before the client it uses goes
            self._follow_ups = None
        if self._llm_pipe is not None:
            self._llm_pipe.close()
            self._llm_pipe = None
        self._llm_stack.close()
        self._llm = None
        self._search_llm = None


def shared_limits(settings: Settings) -> Settings:
    """``settings`` with FACTMILL_RATELIMIT_REDIS_URL set to the embedded Redis when no Redis is named (no
    broker URL): without it every process (each worker child, the API, each MCP server) counted the
    rate limits on its own, N times the rate given."""
    if settings.ratelimit_redis_url or settings.broker_url:
        return settings
    try:
        url = embedded_redis_url(settings.data_dir)
    except EmbeddedUnavailableError as exc:
        logger.warning("rate limits are counted per process: the embedded Redis is unavailable (%s)", exc)
        return settings
    return settings.model_copy(update={"ratelimit_redis_url": url})


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def build_runtime(
    settings: Settings, factory: sessionmaker[Session] | None = None, llm: LLMClient | None = None
) -> Runtime:
    """The resources for one process; ``factory`` and ``llm`` let a test or the CLI supply their own."""
    factory = factory or db.session_factory(db.database_url(settings))
    tracing.instrument_engine(factory.kw.get("bind"))  # when tracing is on: the SQL under each span
    config = ConfigReader(factory, ttl=settings.config_cache_seconds)
    # A supplied client serves searches too: whoever supplies it chose its budget.
    return Runtime(settings=settings, factory=factory, config=config, _llm=llm, _search_llm=llm)


def get_runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = build_runtime(get_settings())
    return _runtime
