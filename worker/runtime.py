"""Per-process resources a worker (or the API) shares between tasks: settings, sessions, LLM, config."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.config_store import ConfigReader
from worker.llm.types import LLMClient
from worker.settings import Settings, get_settings

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    factory: sessionmaker[Session]
    config: ConfigReader
    _llm: LLMClient | None = None
    _llm_stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def llm(self) -> LLMClient:
        """The configured LLM client, opened on first use and kept for the life of the process."""
        if self._llm is None:
            with self._lock:
                if self._llm is None:
                    from worker.llm.budget import Budget, BudgetedClient
                    from worker.llm.gateway import describe, open_llm_client

                    client = self._llm_stack.enter_context(open_llm_client(self.settings))
                    self._llm = BudgetedClient(client, Budget(self.factory, self.config.get))
                    logger.info(describe(self.settings))
        return self._llm

    def close(self) -> None:
        self._llm_stack.close()
        self._llm = None


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def build_runtime(settings: Settings) -> Runtime:
    factory = db.session_factory(db.database_url(settings))
    return Runtime(
        settings=settings, factory=factory, config=ConfigReader(factory, ttl=settings.config_cache_seconds)
    )


def get_runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = build_runtime(get_settings())
    return _runtime
