"""Requests- and tokens-per-minute limits per provider+model, shared by every worker through Redis.

Both limits are GCRA (the generic cell rate algorithm, a leaky bucket kept as one timestamp per key):
each unit (a request, a token) pushes the key's "theoretical arrival time" (TAT) forward by
``60 s / limit``; a call may go when the TAT it would leave is at most ``burst`` units ahead of now.
A call books its place when it asks (the TAT moves on at once) and sleeps until its turn: calls go in
the order they asked. Asking again after each wait instead, a call larger than the burst (a
compaction's transcript behind 64 extraction calls) went only when the bucket was empty, which the
small calls asking meanwhile never let it be: it waited for good. In Redis one Lua script books both
limits atomically on the server's clock, so any number of worker processes share one budget (Celery's
``rate_limit`` is per worker, which is not enough). Without Redis the same arithmetic runs in-process
behind a lock. Waiting is never an error: ``acquire`` sleeps until the call may go.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis

from worker.core import progress
from worker.core.redis_urls import is_redis_url, redis_py_url
from worker.llm.between_tries import CallDeadlineError, between_tries, refuse_wait_past_deadline
from worker.llm.errors import LLMError
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, LLMClient
from worker.settings import Settings

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
MICROS = 1_000_000
KEY_NAMESPACE = "factmill:llm-ratelimit"
# A Redis that accepts and never answers (paused, starved, a partition) held every LLM call in every
# worker for as long as it hung: no timeout was set, and the fail-open path waits for an error. Each
# command now gives up after this long, and after a failure calls skip Redis for REDIS_AWAY_SECONDS
# (else each paid the timeout).
REDIS_TIMEOUT_SECONDS = 1.0
REDIS_AWAY_SECONDS = 5.0


@dataclass(frozen=True)
class RateLimits:
    """Limits for one provider+model. 0 means unlimited.

    ``burst_seconds`` is how much of a minute's allowance may go at once (at least one request, and
    one call's tokens): 1 s keeps the flow smooth, so a fleet never trips the provider's own limiter.
    """

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    burst_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.requests_per_minute < 0 or self.tokens_per_minute < 0:
            raise ValueError("rate limits must not be negative (0 means unlimited)")
        if self.burst_seconds < 0:
            raise ValueError("burst_seconds must not be negative")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    @classmethod
    def from_settings(cls, settings: Settings) -> RateLimits:
        return cls(requests_per_minute=settings.llm_rpm, tokens_per_minute=settings.llm_tpm)

    def interval_us(self, per_minute: int) -> float:
        """Microseconds one unit holds the bucket (0: unlimited)."""
        return 60 * MICROS / per_minute if per_minute > 0 else 0.0

    def tolerance_us(self, per_minute: int) -> float:
        """How far ahead of now the TAT may run: the burst, in microseconds (at least one unit)."""
        interval = self.interval_us(per_minute)
        return max(interval, self.burst_seconds * MICROS) if interval else 0.0


def estimate_request_tokens(request: ChatRequest) -> int:
    """What a call may use before it is made: ~4 characters a token of the prompt, plus the output cap."""
    chars = len(request.system) + sum(len(content) for _, content in request.messages)
    return math.ceil(chars / CHARS_PER_TOKEN) + request.max_tokens


def estimate_embedding_tokens(texts: list[str]) -> int:
    return sum(math.ceil(len(text) / CHARS_PER_TOKEN) for text in texts)


class RateLimiter(Protocol):
    limits: RateLimits

    def acquire(self, key: str, tokens: int) -> float:
        """Block until one request of ``tokens`` tokens may go under ``key``; return the seconds waited."""
        ...

    def reconcile(self, key: str, estimated: int, actual: int) -> None:
        """Correct the tokens charged for a call once its real usage is known."""
        ...


def _gcra_wait(tat: float, now: float, cost: float, tolerance: float) -> tuple[float, float]:
    """(seconds-or-micros to wait, the new TAT if it goes now) for one limit. Same units in, same out.

    A call that costs more than the whole burst may go once the bucket is empty (and runs it into debt),
    so a large request is delayed, never refused forever.
    """
    start = max(tat, now)
    new_tat = start + cost
    return max(0.0, new_tat - now - max(tolerance, cost)), new_tat


def _wait_for_place(wait: float, sleep: Callable[[float], None], unbook: Callable[[], None]) -> float:
    """Sleep until a booked place's turn (``wait`` seconds); one that would come past the calls' deadline
    is given back (``unbook``: no call goes in it) and the call refused now (CallDeadlineError). A long
    wait says now and then that it is a wait (worker.core.progress): at a tight limit behind a long
    queue it may pass the job's stall limit, and the lease lapsed under a run that was only waiting."""
    if wait > 0:
        try:
            refuse_wait_past_deadline(wait)
        except CallDeadlineError:
            unbook()
            raise
        left = wait
        while left > 0:
            step = min(left, progress.MARK_EVERY_SECONDS)
            sleep(step)
            left -= step
            progress.mark()
    return wait


class LocalRateLimiter:
    """The limits within one process (all its threads), for when no Redis is configured."""

    def __init__(
        self,
        limits: RateLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tats: dict[str, float] = {}  # key -> TAT in microseconds on `clock`

    def _costs(self, key: str, tokens: int) -> list[tuple[str, float, float]]:
        """(TAT name, cost µs, tolerance µs) of each limit that is on."""
        limits = self.limits
        return [
            (f"{key}:{suffix}", units * limits.interval_us(per_minute), limits.tolerance_us(per_minute))
            for suffix, per_minute, units in (
                ("rpm", limits.requests_per_minute, 1),
                ("tpm", limits.tokens_per_minute, tokens),
            )
            if per_minute > 0
        ]

    def _book(self, key: str, tokens: int) -> float:
        """Book the call's place in both limits; the seconds until it may go."""
        with self._lock:
            now = self._clock() * MICROS
            wait = 0.0
            for name, cost, tolerance in self._costs(key, tokens):
                need, self._tats[name] = _gcra_wait(self._tats.get(name, now), now, cost, tolerance)
                wait = max(wait, need)
            return wait / MICROS

    def _unbook(self, key: str, tokens: int) -> None:
        with self._lock:
            now = self._clock() * MICROS
            for name, cost, _ in self._costs(key, tokens):
                self._tats[name] = max(self._tats.get(name, now) - cost, now)

    def acquire(self, key: str, tokens: int) -> float:
        return _wait_for_place(self._book(key, tokens), self._sleep, lambda: self._unbook(key, tokens))

    def reconcile(self, key: str, estimated: int, actual: int) -> None:
        per_minute = self.limits.tokens_per_minute
        if per_minute <= 0 or actual == estimated:
            return
        delta = (actual - estimated) * self.limits.interval_us(per_minute)
        name = f"{key}:tpm"
        with self._lock:
            now = self._clock() * MICROS
            tat = self._tats.get(name, now)
            self._tats[name] = max(tat, now) + delta if delta > 0 else max(tat + delta, now)


# KEYS[1] rpm key, KEYS[2] tpm key. ARGV: rpm interval µs, rpm tolerance µs, tpm interval µs,
# tpm tolerance µs, tokens. Interval 0 = that limit is off. Books the call and returns the µs it waits
# for its turn (0: it goes now).
# The clock is the Redis server's, so every worker measures against the same time.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local costs = {tonumber(ARGV[1]), tonumber(ARGV[3]) * tonumber(ARGV[5])}
local tolerances = {tonumber(ARGV[2]), tonumber(ARGV[4])}
local wait = 0
local new_tats = {}
for i = 1, 2 do
  if costs[i] > 0 then
    local tat = tonumber(redis.call('GET', KEYS[i])) or now
    if tat < now then tat = now end
    local new_tat = tat + costs[i]
    local allowed = math.max(tolerances[i], costs[i])
    local need = new_tat - now - allowed
    if need > wait then wait = need end
    new_tats[i] = new_tat
  end
end
for i = 1, 2 do
  if new_tats[i] then
    local ttl = math.ceil((new_tats[i] - now) / 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.0f', new_tats[i]), 'PX', ttl)
  end
end
if wait > 0 then
  return math.ceil(wait)
end
return 0
"""

# KEYS[1] tpm key. ARGV[1]: µs to add (negative: give back). Never moves the TAT behind now.
_RECONCILE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local delta = tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil then
  if delta <= 0 then return 0 end
  tat = now
end
local new_tat
if delta > 0 then
  new_tat = math.max(tat, now) + delta
else
  new_tat = math.max(tat + delta, now)
end
local ttl = math.ceil((new_tat - now) / 1000) + 1000
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', ttl)
return 0
"""


class RedisRateLimiter:
    """The limits across every process that shares the Redis (and key prefix)."""

    def __init__(
        self,
        client: redis.Redis,
        limits: RateLimits,
        *,
        prefix: str = "",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.limits = limits
        self._redis = client
        self._prefix = f"{prefix}{KEY_NAMESPACE}"
        self._sleep = sleep
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._reconcile = client.register_script(_RECONCILE_LUA)
        self._warned = False
        self._away_until = 0.0  # monotonic time; Redis is not asked before it

    @classmethod
    def from_url(cls, url: str, limits: RateLimits, *, prefix: str = "") -> RedisRateLimiter:
        client = redis.Redis.from_url(
            redis_py_url(url),
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
        )
        return cls(client, limits, prefix=prefix)

    def _away(self) -> bool:
        return time.monotonic() < self._away_until

    def _keys(self, key: str) -> list[str]:
        return [f"{self._prefix}:{key}:rpm", f"{self._prefix}:{key}:tpm"]

    def _redis_failed(self, exc: redis.RedisError) -> None:
        # Fail open: the provider's own 429s (retried with Retry-After) still hold the line, and a Redis
        # outage must not stop extraction. Said once per process, not once per call.
        self._away_until = time.monotonic() + REDIS_AWAY_SECONDS
        if not self._warned:
            self._warned = True
            logger.warning("rate limiter Redis unavailable, calls go unthrottled until it is back: %s", exc)

    def acquire(self, key: str, tokens: int) -> float:
        limits = self.limits
        args = [
            limits.interval_us(limits.requests_per_minute),
            limits.tolerance_us(limits.requests_per_minute),
            limits.interval_us(limits.tokens_per_minute),
            limits.tolerance_us(limits.tokens_per_minute),
            max(0, tokens),
        ]
        keys = self._keys(key)
        if self._away():
            return 0.0
        try:
            wait = int(self._acquire(keys=keys, args=args)) / MICROS
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return 0.0
        self._warned = False
        return _wait_for_place(wait, self._sleep, lambda: self._unbook(keys, args))

    def _unbook(self, keys: list[str], args: list[float]) -> None:
        rpm_interval, _, tpm_interval, _, tokens = args
        try:
            for name, cost in zip(keys, (rpm_interval, tpm_interval * tokens), strict=True):
                if cost > 0:
                    self._reconcile(keys=[name], args=[-round(cost)])
        except redis.RedisError as exc:
            self._redis_failed(exc)

    def reconcile(self, key: str, estimated: int, actual: int) -> None:
        per_minute = self.limits.tokens_per_minute
        if per_minute <= 0 or actual == estimated or self._away():
            return
        delta = round((actual - estimated) * self.limits.interval_us(per_minute))
        try:
            self._reconcile(keys=[self._keys(key)[1]], args=[delta])
        except redis.RedisError as exc:
            self._redis_failed(exc)


def ratelimit_redis_url(settings: Settings) -> str | None:
    """FACTMILL_RATELIMIT_REDIS_URL, else the broker when it is Redis, else None (in-process limits)."""
    if settings.ratelimit_redis_url:
        return settings.ratelimit_redis_url
    broker = settings.broker_url
    if broker and is_redis_url(broker):
        return broker
    return None


# The in-process limiters by their limits: two clients of one process each with its own limiter let the
# process through at twice the rate it was given.
_LOCAL_LIMITERS: dict[RateLimits, LocalRateLimiter] = {}
_LOCAL_LOCK = threading.Lock()


def build_rate_limiter(settings: Settings) -> RateLimiter | None:
    """The limiter the settings ask for: None when no limit is set, Redis-backed when Redis is known."""
    limits = RateLimits.from_settings(settings)
    if not limits.enabled:
        return None
    url = ratelimit_redis_url(settings)
    if url is None:
        with _LOCAL_LOCK:  # one a process: the work and search clients (each built apart) share it
            limiter = _LOCAL_LIMITERS.get(limits)
            if limiter is None:
                logger.info("LLM rate limits are per process (no Redis configured): %s", limits)
                limiter = _LOCAL_LIMITERS[limits] = LocalRateLimiter(limits)
        return limiter
    return RedisRateLimiter.from_url(url, limits, prefix=settings.broker_key_prefix)


class RateLimitedClient:
    """An LLMClient that waits for the limiter before each call of ``inner`` (waiting is not an error)."""

    def __init__(self, inner: LLMClient, limiter: RateLimiter) -> None:
        self.inner = inner
        self.limiter = limiter
        self.provider = inner.provider
        self.model = inner.model
        self._chat_key = f"{inner.provider}:{inner.model}"
        self._embed_key = getattr(inner, "embedding_key", self._chat_key)

    def chat(self, request: ChatRequest) -> ChatResponse:
        estimated = estimate_request_tokens(request)
        waited = self.limiter.acquire(self._chat_key, estimated)
        if waited > 0:
            logger.debug("waited %.3fs for the %s rate limit", waited, self._chat_key)
            try:
                between_tries()  # the wait may have been long: what stops the caller is asked again
            except Exception:
                self.limiter.reconcile(self._chat_key, estimated, 0)  # no call made: nothing charged
                raise
        try:
            response = self.inner.chat(request)
        except LLMError as exc:
            # A refused try wrote nothing: its output cap is given back (its prompt may have counted).
            # Kept whole, every try of a 429 storm charged the cap again and pushed the limiter ahead.
            # A reply the provider answered but that could not be used counted what it billed.
            billed = exc.usage
            actual = (
                estimated - request.max_tokens
                if billed is None
                else _charged(estimated, billed.input_tokens + billed.output_tokens)
            )
            self.limiter.reconcile(self._chat_key, estimated, actual)
            raise
        usage = response.usage
        self.limiter.reconcile(
            self._chat_key, estimated, _charged(estimated, usage.input_tokens + usage.output_tokens)
        )
        return response

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        estimated = estimate_embedding_tokens(texts)
        self.limiter.acquire(self._embed_key, estimated)
        response = self.inner.embed(texts, purpose=purpose)
        self.limiter.reconcile(self._embed_key, estimated, _charged(estimated, response.usage.input_tokens))
        return response


def _charged(estimated: int, reported: int) -> int:
    """The tokens a call is charged once done: what the provider reported, but never more than a token a
    character of its prompt (plus its output cap) could come to. A reply of two billion tokens (an odd
    OpenAI-compatible server) moved the shared limiter two weeks ahead, stalling every worker's calls.
    A reply that reports no usage (servers that leave it out) keeps its estimate: refunded whole, it
    left the tokens-a-minute limit nothing to hold for that server."""
    if reported <= 0:
        return estimated
    return min(reported, estimated * CHARS_PER_TOKEN)
