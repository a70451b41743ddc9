"""The gateway's one retry layer: a typed policy and a client wrapper that retries with tenacity."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import tenacity

from worker.core.errors import error_summary
from worker.llm.between_tries import TRIES_ATTRIBUTE, CallDeadlineError, between_tries
from worker.llm.deadline import time_left
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, LLMClient
from worker.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", ChatResponse, EmbeddingResponse)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed LLM call is tried again.

    ``max_attempts`` counts every try (1 = never retry). ``max_total_wait_seconds`` bounds the time
    spent sleeping between tries of one call (not the time the tries themselves take). The n-th
    retry sleeps ``backoff_base_seconds * 2**(n-1)`` capped at ``backoff_max_seconds``, shortened by
    up to ``jitter`` of itself at random (0 = none, 1 = "full jitter"), so workers that failed together
    do not retry together. A ``Retry-After`` from the provider is waited instead when it is longer
    (never shortened, plus a little jitter on top; a shorter one, 0 even, waits the backoff), but no
    sleep is longer than what is left of the total wait; a
    Retry-After past what is left ends the tries at once (sleeping the rest of the budget only to try
    once more before the provider said held a slot for minutes and spent a request for nothing).
    """

    max_attempts: int = 5
    max_total_wait_seconds: float = 120.0
    backoff_base_seconds: float = 0.5
    backoff_max_seconds: float = 20.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_total_wait_seconds < 0:
            raise ValueError("max_total_wait_seconds must not be negative")
        if self.backoff_base_seconds < 0 or self.backoff_max_seconds < 0:
            raise ValueError("backoff seconds must not be negative")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter}")

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            max_attempts=settings.llm_max_attempts,
            max_total_wait_seconds=settings.llm_max_total_wait_seconds,
            backoff_base_seconds=settings.llm_backoff_base_seconds,
            backoff_max_seconds=settings.llm_backoff_max_seconds,
        )

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """The sleep before retry ``retry_number`` (1-based) when the provider gave no Retry-After."""
        exponent = min(max(retry_number - 1, 0), 62)  # 2**62 s is forever already; avoid float overflow
        ceiling = min(self.backoff_max_seconds, self.backoff_base_seconds * 2.0**exponent)
        draw = (rng or random).random()
        return ceiling * (1.0 - self.jitter * draw)

    def delay(
        self,
        retry_number: int,
        retry_after: float | None,
        waited_seconds: float,
        rng: random.Random | None = None,
    ) -> float:
        """The sleep before retry ``retry_number``: the backoff, or a longer Retry-After (a little jitter
        on top), within the remaining wait budget."""
        if retry_after is not None:
            # A little jitter on top only: the provider said "not before". Never less than the backoff:
            # a Retry-After of 0 (some gateways send it) had the five tries go out within a second.
            jittered = retry_after + self.jitter * self.backoff_base_seconds * (rng or random).random()
            wanted = max(jittered, self.backoff(retry_number, rng))
        else:
            wanted = self.backoff(retry_number, rng)
        return max(0.0, min(wanted, self.max_total_wait_seconds - waited_seconds))

    def wait_budget_spent(self, waited_seconds: float, retry_after: float | None = None) -> bool:
        """Whether the tries end: the total wait is used up, or the provider asked for more than is left."""
        left = self.max_total_wait_seconds - waited_seconds
        return left <= 0 or (retry_after is not None and retry_after > left)


@dataclass(frozen=True)
class AttemptRecord:
    """One try of one call, as the retry layer saw it: enough for a listener to write an ``llm_calls`` row.

    ``error`` is None for the try that succeeded, and ``response`` is set only on that one.
    """

    number: int
    error: LLMError | None
    latency_ms: int
    purpose: str = ""
    provider: str = ""
    model: str = ""
    # The sleep chosen before the next try; None when there was no next try.
    retry_in_seconds: float | None = None
    response: ChatResponse | EmbeddingResponse | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Traced(Generic[T]):
    """A result and every try it took (the last one is the success)."""

    value: T
    attempts: tuple[AttemptRecord, ...]

    @property
    def failed_attempts(self) -> tuple[AttemptRecord, ...]:
        return tuple(a for a in self.attempts if a.error is not None)


AttemptListener = Callable[[AttemptRecord], None]


class _WaitBudgetSpent(tenacity.stop.stop_base):
    """Stop once the policy's total wait is used up (tenacity's stop_before_delay counts wall time)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        retry_after = exc.retry_after if isinstance(exc, LLMError) else None
        left = time_left()
        if retry_after is not None and left is not None and retry_after >= left:
            # The provider's "not before" is past the caller's deadline (a search's 10 s): its 429 is the
            # answer now. Waited out to the deadline, the next try was refused anyway, the thread held
            # the whole time, and the caller was told the LLM was slow.
            return True
        return self.policy.wait_budget_spent(retry_state.idle_for, retry_after)


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, LLMError) and exc.retryable


class RetryingClient:
    """An LLMClient that retries the retryable failures of ``inner`` under a RetryPolicy.

    Non-retryable errors are raised at once. When it gives up it raises the last LLMError, with
    ``error.attempts`` holding every try. ``chat_traced``/``embed_traced`` also return the tries of a
    call that succeeded; ``on_attempt`` (if given) hears about each try once its fate is known, so a
    caller can record it (metrics, ``llm_calls`` rows). Safe to share between threads.
    """

    def __init__(
        self,
        inner: LLMClient,
        policy: RetryPolicy | None = None,
        *,
        on_attempt: AttemptListener | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.provider = inner.provider
        self.model = inner.model
        self._on_attempt = on_attempt
        self._rng = rng or random.Random()
        # One controller for every call, from every thread (tenacity keeps its per-call state
        # thread-local): building one per call cost more than its retry logic (py-spy of a worker).
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.policy.max_attempts) | _WaitBudgetSpent(self.policy),
            wait=self._wait,
            retry=tenacity.retry_if_exception(_is_retryable),
            before_sleep=self._before_sleep,
            sleep=sleep,
            reraise=True,
        )

    def chat(self, request: ChatRequest) -> ChatResponse:
        return self.chat_traced(request).value

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        return self.embed_traced(texts, purpose=purpose).value

    def chat_traced(self, request: ChatRequest) -> Traced[ChatResponse]:
        return self._call("chat", request.purpose, lambda: self.inner.chat(request))

    def embed_traced(self, texts: list[str], *, purpose: str = "embedding") -> Traced[EmbeddingResponse]:
        return self._call("embed", purpose, lambda: self.inner.embed(texts, purpose=purpose))

    def _emit(self, record: AttemptRecord) -> None:
        if self._on_attempt is not None:
            try:
                self._on_attempt(record)
            except Exception as exc:  # a broken listener must not turn a good call into a failed one
                logger.error("the retry attempt listener failed: %s", error_summary(exc))
                logger.debug("traceback of the listener's error", exc_info=exc)

    def _call(self, operation: str, purpose: str, fn: Callable[[], R]) -> Traced[R]:
        call = _Call(operation, purpose)
        records = call.records
        try:
            value = self._retrying(self._attempt, call, fn)
        except LLMError as exc:
            exc.attempts = tuple(records)
            if records and records[-1].retry_in_seconds is None:  # a retried one was told in _before_sleep
                self._emit(records[-1])
            if len(records) > 1:
                logger.warning(
                    "LLM %s (%s) via %s/%s gave up after %d attempts: %s",
                    operation,
                    purpose,
                    self.provider,
                    self.model,
                    len(records),
                    exc,
                )
            raise
        except BaseException as exc:  # the caller's check (or a SIGTERM) stopped it between tries
            if records:
                setattr(exc, TRIES_ATTRIBUTE, tuple(records))
            raise
        success = AttemptRecord(
            len(records) + 1, None, value.latency_ms, purpose, self.provider, self.model, response=value
        )
        records.append(success)
        self._emit(success)
        return Traced(value, tuple(records))

    def _attempt(self, call: _Call, fn: Callable[[], R]) -> R:
        # Providers turn every SDK failure into an LLMError (classified in errors.py); anything else is
        # a bug and propagates untouched, never retried.
        if call.records:  # a retry: what stops the caller (a kill switch, a lost lease) is asked first
            between_tries()
        elif time_left() == 0:  # a call begun past its caller's deadline: no first try either
            raise CallDeadlineError()
        try:
            return fn()
        except (BudgetExhaustedError, CallDeadlineError):
            raise  # a budget or the deadline refused the try (after a rate limit's wait): no request made
        except LLMError as exc:
            records = call.records
            records.append(
                AttemptRecord(len(records) + 1, exc, exc.latency_ms, call.purpose, self.provider, self.model)
            )
            raise

    def _wait(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = exc.retry_after if isinstance(exc, LLMError) else None
        delay = self.policy.delay(state.attempt_number, retry_after, state.idle_for, self._rng)
        left = time_left()  # a caller's deadline ends the wait (and the next try, between_tries)
        return delay if left is None else min(delay, left)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        call: _Call = state.args[0]
        last = call.records[-1] = replace(call.records[-1], retry_in_seconds=state.upcoming_sleep)
        logger.warning(
            "LLM %s (%s) via %s/%s failed (attempt %d of %d): %s; retrying in %.2fs",
            call.operation,
            call.purpose,
            self.provider,
            self.model,
            last.number,
            self.policy.max_attempts,
            last.error,
            state.upcoming_sleep,
        )
        self._emit(last)


@dataclass
class _Call:
    """One call through RetryingClient: what its tries recorded (tenacity hands it to the hooks)."""

    operation: str
    purpose: str
    records: list[AttemptRecord] = field(default_factory=list)


def chat_with_tries(llm: LLMClient, request: ChatRequest) -> tuple[ChatResponse, tuple[AttemptRecord, ...]]:
    """``llm``'s reply to ``request`` and the failed tries the retry layer made before it (each cost a
    request, and the caller records each as a call: through ``chat`` they were hidden). None from a
    client without a retry layer."""
    traced = getattr(llm, "chat_traced", None)
    if traced is None:
        return llm.chat(request), ()
    result: Traced[ChatResponse] = traced(request)
    return result.value, result.failed_attempts


def embed_with_tries(
    llm: LLMClient, texts: list[str], purpose: str
) -> tuple[EmbeddingResponse, tuple[AttemptRecord, ...]]:
    """``chat_with_tries`` for an embedding call."""
    traced = getattr(llm, "embed_traced", None)
    if traced is None:
        return llm.embed(texts, purpose=purpose), ()
    result: Traced[EmbeddingResponse] = traced(texts, purpose=purpose)
    return result.value, result.failed_attempts
