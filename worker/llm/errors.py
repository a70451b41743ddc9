"""Every provider exception is classified here, once: retryable or not, and with what message."""

from __future__ import annotations

from dataclasses import dataclass

import anthropic
import httpx
import openai


class LLMError(Exception):
    """A call that produced no usable response. ``retryable`` says whether trying again may help."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        latency_ms: int = 0,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.latency_ms = latency_ms


@dataclass(frozen=True)
class Classification:
    retryable: bool
    status: int | None
    retry_after: float | None
    message: str


def _retry_after(response: httpx.Response | None) -> float | None:
    if response is None:
        return None
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def classify(exc: BaseException) -> Classification:
    """Sort an SDK or transport exception into retry (429, 5xx, 529, timeouts, connection) or fail."""
    if isinstance(exc, openai.APITimeoutError | anthropic.APITimeoutError | httpx.TimeoutException):
        return Classification(True, None, None, f"the provider timed out: {exc}")
    if isinstance(exc, openai.APIConnectionError | anthropic.APIConnectionError | httpx.TransportError):
        return Classification(True, None, None, f"could not reach the provider: {exc}")
    if isinstance(exc, openai.APIStatusError | anthropic.APIStatusError):
        status = exc.status_code
        retryable = status == 429 or status >= 500
        return Classification(retryable, status, _retry_after(exc.response), f"HTTP {status}: {exc.message}")
    return Classification(False, None, None, f"{type(exc).__name__}: {exc}")


def to_llm_error(exc: BaseException, latency_ms: int = 0) -> LLMError:
    c = classify(exc)
    return LLMError(
        c.message, retryable=c.retryable, status=c.status, retry_after=c.retry_after, latency_ms=latency_ms
    )
