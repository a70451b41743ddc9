"""A check the gateway runs between the tries of one call: the caller's kill switch, lease and budgets.

A call can last minutes under the gateway (five tries of up to a minute each, two minutes of backoff,
and a rate limit's wait before each), while its caller checks what stops it only before the call: a
kill switch turned off during a provider's incident (when it is used) let every call in flight go on
retrying for as long. The caller sets its check for the calls it makes (``checked_between_tries``); the
retry layer runs it before each try after the first, the rate limiter after each wait. What the check
raises ends the call; the tries made before it are on the exception (``tries_before_stop``) for the
caller to record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from worker.llm.deadline import time_left
from worker.llm.errors import LLMError

_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("factmill_llm_between_tries", default=None)
TRIES_ATTRIBUTE = "llm_tries_before_stop"


class CallDeadlineError(LLMError):
    """The caller's time for its calls ran out between two tries (``call_deadline``): no call was made."""

    def __init__(self) -> None:
        super().__init__("the time allowed for these calls ran out before another try", retryable=False)


@contextmanager
def checked_between_tries(check: Callable[[], None] | None) -> Iterator[None]:
    """Run ``check`` between the tries of the calls made inside (in this thread or task)."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


def between_tries() -> None:
    """Run the caller's check, if it set one; past the calls' deadline, CallDeadlineError."""
    check = _CHECK.get()
    if check is not None:
        check()
    left = time_left()
    if left is not None and left <= 0:
        raise CallDeadlineError()


def refuse_wait_past_deadline(seconds: float) -> None:
    """A rate limit's wait that would end at or past the calls' deadline: CallDeadlineError now, not
    after it (a search whose key's limit was minutes ahead slept them out, then was refused)."""
    left = time_left()
    if left is not None and seconds >= left:
        raise CallDeadlineError()


def tries_before_stop(exc: BaseException) -> tuple[Any, ...]:
    """The gateway's tries (AttemptRecord) made before ``exc`` stopped the call between two of them."""
    return tuple(getattr(exc, TRIES_ATTRIBUTE, ()))
