"""Requests per minute per API key for routes that may spend LLM budget (search): a fixed one-minute
window per key, counted in Redis when one is configured (shared by every API process), else in-process.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from worker.core.redis_urls import redis_py_url
from worker.llm.ratelimit import ratelimit_redis_url
from worker.runtime import Runtime
from worker.settings import Settings

logger = logging.getLogger(__name__)

KEY_NAMESPACE = "factmill:api-ratelimit"
WINDOW_SECONDS = 60
# After a Redis error, count in this process for this long, then try Redis again.
REDIS_RETRY_SECONDS = 30.0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after: int  # seconds until the window resets (when refused)


class PerKeyLimiter:
    """``hit(who)`` counts one request of ``who`` in the current minute and says whether it may go."""

    def __init__(self, per_minute: int, redis_url: str | None = None, prefix: str = "") -> None:
        self.per_minute, self.prefix = per_minute, prefix
        self._redis = redis.Redis.from_url(redis_py_url(redis_url), socket_timeout=1) if redis_url else None
        self._lock = threading.Lock()
        self._local: dict[tuple[str, int], int] = {}
        self._redis_away_until: float | None = None  # monotonic time; None while Redis answers

    @classmethod
    def from_settings(cls, settings: Settings) -> PerKeyLimiter:
        return cls(settings.search_rate_per_minute, ratelimit_redis_url(settings), settings.broker_key_prefix)

    @classmethod
    def for_runtime(cls, runtime: Runtime) -> PerKeyLimiter:
        """The limiter of a serving process: counted in Redis, the embedded one when none is named."""
        return cls.from_settings(runtime.limits_settings(limited=runtime.settings.search_rate_per_minute > 0))

    def hit(self, who: str, now: float | None = None) -> Verdict:
        if self.per_minute <= 0:
            return Verdict(True, 0)
        current = time.time() if now is None else now
        window = int(current // WINDOW_SECONDS)
        retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - current))
        count = self._count(who, window)
        return Verdict(count <= self.per_minute, retry_after)

    def _count(self, who: str, window: int) -> int:
        away_until = self._redis_away_until
        if self._redis is not None and (away_until is None or time.monotonic() >= away_until):
            key = f"{self.prefix}{KEY_NAMESPACE}:{who}:{window}"
            try:
                pipe = self._redis.pipeline()
                pipe.incr(key)
                pipe.expire(key, WINDOW_SECONDS * 2)
                count, _ = pipe.execute()
            except redis.RedisError as exc:
                # Counting per process is weaker but never blocks reads because Redis is away; Redis is
                # tried again after a while (for good, one blip made the limit per process until restart).
                if away_until is None:
                    logger.warning("per-key rate limit falls back to this process: Redis failed (%s)", exc)
                self._redis_away_until = time.monotonic() + REDIS_RETRY_SECONDS
            else:
                if away_until is not None:
                    logger.info("per-key rate limit is shared through Redis again")
                    self._redis_away_until = None
                return int(count)
        with self._lock:
            for stale in [k for k in self._local if k[1] < window]:
                del self._local[stale]
            self._local[(who, window)] = self._local.get((who, window), 0) + 1
            return self._local[(who, window)]


class InFlightPerKey:
    """How many requests each key has running in this process, at most ``most`` (0: no limit). The
    per-minute limit counts requests begun: sixty slow searches begun at once (each may wait a minute
    on the LLM) took every thread of the API's pool, and every other tenant's request waited."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def enter(self, who: str) -> bool:
        """Count one more of ``who``'s requests, or False (nothing counted) when it has ``most`` already."""
        if self.most <= 0:
            return True
        with self._lock:
            running = self._running.get(who, 0)
            if running >= self.most:
                return False
            self._running[who] = running + 1
            return True

    @contextmanager
    def held(self, who: str, refused: Callable[[], Exception]) -> Iterator[None]:
        """One of ``who``'s places for the block, or ``refused()`` raised when it has none left."""
        if not self.enter(who):
            raise refused()
        try:
            yield
        finally:
            self.leave(who)

    def leave(self, who: str) -> None:
        if self.most <= 0:
            return
        with self._lock:
            left = self._running.get(who, 0) - 1
            if left > 0:
                self._running[who] = left
            else:
                self._running.pop(who, None)


__all__ = ["InFlightPerKey", "PerKeyLimiter", "Verdict"]
