"""Every provider exception is classified here, once: retryable or not, and with what message."""

from __future__ import annotations

import email.utils
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, cast

from worker.core.jsonvalues import made_storable
from worker.llm.types import Usage

if TYPE_CHECKING:
    import anthropic
    import openai

    from worker.llm.retry import AttemptRecord

# Status codes worth another try: throttling, a request timeout, a conflict (a lock the provider timed
# out on: both SDKs try 409 again, but their own retries are off here), and every server-side failure
# (500, 502, 503, 504, and Anthropic's 529 overloaded).
RETRYABLE_STATUS = frozenset({408, 409, 429})
# Errors that blame the account or the deployment's settings, not the request's content: a spent credit
# balance (Anthropic answers it with a 400), a parameter the configured model does not take (OpenAI's
# reasoning models refuse max_tokens), a model or key that is wrong. Another segment gets the same
# answer, so they must never count against a segment: a billing outage skipped one segment a page.
DEPLOYMENT_ERROR_TYPES = frozenset(
    {"authentication_error", "permission_error", "not_found_error", "billing_error", "insufficient_quota"}
)
# What an account's money ran out says (OpenAI's 429 insufficient_quota and billing limit, Anthropic's
# billing_error, its 400 about the credit balance, and the error_code of its spend-limit 429s and 402s).
ACCOUNT_EXHAUSTED_CODES = frozenset(
    {
        "insufficient_quota",
        "billing_hard_limit_reached",
        "billing_error",
        "enforced_spend_limit_reached",
        "contract_spend_limit_reached",
        "linked_organization_spend_limit_reached",
        "linked_organization_billing_unavailable",
    }
)
DEPLOYMENT_ERROR_CODES = ACCOUNT_EXHAUSTED_CODES | frozenset(
    {
        "account_deactivated",
        "invalid_api_key",
        "model_not_found",
        "unsupported_parameter",
        "unsupported_value",
        # Anthropic's error.details.error_code under a 400 or 403 about the organization, the key or the
        # workspace's settings (the SDK's ERROR_CLASSES names them): no segment's doing.
        "organization_on_hold",
        "cmek_key_disabled",
        "cmek_key_network_blocked",
        "workspace_policy_violation",
        "key_profile_mismatch",
        "user_profile_required",
        "user_profile_not_found",
        "user_profile_cleared",
        "user_profile_not_billable",
        "user_profile_billing_not_authorized",
        "api_key_requester_unconfirmed",
    }
)
# Anthropic's credit balance; and an output cap (FACTMILL_LLM_MAX_OUTPUT_TOKENS) over the model's limit,
# which every request meets alike (OpenAI names the parameter too: DEPLOYMENT_ERROR_PARAMS).
DEPLOYMENT_ERROR_PHRASES = (
    "credit balance",
    "maximum allowed number of output tokens",
    "max_tokens is too large",
)
DEPLOYMENT_ERROR_PARAMS = frozenset({"max_tokens", "max_completion_tokens"})


class LLMError(Exception):
    """A call that produced no usable response. ``retryable`` says whether trying again may help;
    ``deployment_fault`` that the provider blamed the account or the settings, not this request.

    ``attempts`` is filled in by the retry layer when it gives up: every attempt it made, in order.
    ``outcome`` is what llm_calls and audit rows record for it.
    """

    outcome = "provider_error"

    @property
    def log_text(self) -> str:
        """What a log line says of it: an HTTP error's status and the provider's code, never its words
        (a gateway may quote the request in them: page text); our own words otherwise (a timeout, an
        unreachable host, a reply of the wrong shape). The words stay in llm_calls and the audit."""
        if self.status is None:
            return str(self)
        return f"HTTP {self.status}" + (f" ({self.code})" if self.code else "")

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        latency_ms: int = 0,
        deployment_fault: bool = False,
        usage: Usage | None = None,
        answered_by: tuple[str, str] | None = None,
        code: str | None = None,
        unreachable: bool = False,
        too_large: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.unreachable = unreachable  # no connection to the provider (refused, reset, no DNS answer)
        # The request alone is over a per-minute limit (OpenAI's 429 "Request too large ... on tokens per
        # min"): no wait serves it, so it is the request's fault, as a 413 is.
        self.too_large = too_large
        self.retryable = retryable
        self.deployment_fault = deployment_fault
        self.status = status
        self.retry_after = retry_after
        self.latency_ms = latency_ms
        # What the provider billed for a reply it answered but that could not be used (a 200 of the
        # wrong shape): recorded with the failure, or such a call cost nothing in the budgets.
        self.usage = usage
        # (provider, model) of that reply where it is not the client's chat model (an embeddings
        # endpoint): its tokens are priced as that model's.
        self.answered_by = answered_by
        self.attempts: tuple[AttemptRecord, ...] = ()


def provider_unavailable(exc: BaseException) -> bool:
    """The provider cannot serve now (429, 5xx, 529, or no connection to it: refused, reset, no DNS
    answer) and the retry layer's patience ran out: an outage, infrastructure's fault, not the job's.
    A network blip of two minutes spent every job in flight's five attempts. Timeouts (408 too) are
    not: a request too large to finish in time fails the same way on every try; but a connect that timed
    out is unreachable (no request reached the provider). (A base URL that does not resolve is
    unreachable too: its jobs wait on their outage clock before failing.)"""
    if not isinstance(exc, LLMError) or exc.deployment_fault or exc.too_large:
        return False
    # By the status, not ``retryable``: a provider's x-should-retry says whether to try again now, not
    # whose fault it is (a 400 it asked to be tried again is still the request's; a 503 it asked not to
    # be, still an outage).
    status = exc.status
    return exc.unreachable or (status is not None and status != 408 and _worth_another_try(status))


def account_exhausted(exc: BaseException) -> bool:
    """The provider refused for the account's money (a spent quota or credit balance): every call fails
    alike until someone pays, then all succeed. No job's own fault: retried as a job's failure, its
    five attempts failed every job in flight within a minute, and none came back after the top-up."""
    return (
        isinstance(exc, LLMError)
        and exc.deployment_fault
        and (exc.code in ACCOUNT_EXHAUSTED_CODES or exc.status == 402 or "credit balance" in str(exc).lower())
    )


def provider_cannot_serve(exc: BaseException) -> bool:
    """The provider cannot serve now through no request's doing: an outage past the retry layer's
    patience (provider_unavailable), or the account's money spent (account_exhausted). The one test the
    job kinds use to let the job wait the outage out (worker.jobs.outages), not fail it on its own."""
    return provider_unavailable(exc) or account_exhausted(exc)


class NoEmbeddingsError(LLMError):
    """The provider has no embeddings API (Anthropic without an OpenAI key): no call was made, and
    trying again cannot help. Vector search is unavailable rather than failing."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False, deployment_fault=True)


class BudgetExhaustedError(LLMError):
    """No LLM call was made: a budget is spent. Work waits (paused) until the budget has room."""

    outcome = "budget_exhausted"

    def __init__(self, scope: str, limit: Decimal, spent: Decimal, *, key: str) -> None:
        # No figures in the words: they become the paused job's note (and its pages' reasons), which any
        # read key sees, a tenant's included; spend and budgets are the metrics' and the admin's
        # (`factmill costs`, the spend counters on /metrics). The figures stay on the exception.
        super().__init__(
            f"the {scope} LLM budget is exhausted (`factmill costs` shows the spend); raise it with "
            f"`factmill config set {key} <usd>`; waiting jobs resume by themselves",
            retryable=False,
        )
        self.scope, self.limit, self.spent = scope, limit, spent


@dataclass(frozen=True)
class Classification:
    retryable: bool
    status: int | None
    retry_after: float | None
    message: str
    deployment_fault: bool = False
    code: str | None = None  # the error body's code or type ("rate_limit_exceeded"), for log lines
    unreachable: bool = False  # no connection to the provider (LLMError.unreachable)
    too_large: bool = False  # (LLMError.too_large)


def retry_after_seconds(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds the server asked to wait: ``retry-after-ms``, else ``Retry-After`` (seconds or HTTP date)."""
    if headers is None:
        return None
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            value = float(millis) / 1000
            if math.isfinite(value):
                return max(0.0, value)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
        return max(0.0, value) if math.isfinite(value) else None
    except ValueError:
        pass
    try:
        parsed = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError, OverflowError):  # (an offset past any time zone)
        return None
    return max(0.0, parsed.timestamp() - (time.time() if now is None else now))


def _headers(exc: BaseException) -> Mapping[str, str] | None:
    response: Any = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    return headers if isinstance(headers, Mapping) else None


# A provider's error message is kept (llm_calls, the audit, the job's last error, the logs) up to this
# many characters: a server that answers an error with a whole page of HTML, or echoes the request,
# would otherwise put all of it in every row and line.
MAX_PROVIDER_MESSAGE_CHARS = 1_000


_CODE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# What names the deployment's account in a provider's words ("Rate limit reached ... in organization
# org-<24 characters> ...", "Incorrect API key provided: sk-proj-****wxyz", "your organization (<uuid>)"):
# the words reach a job's note, which a tenant's read key reads, and they are the deployment's, not the
# job's. A request id stays (the one id a provider's support asks for), and words like "user-provided".
_ACCOUNT_IDS = re.compile(r"\b(?:org|proj|user)[-_][A-Za-z0-9]{16,}\b|\bsk-[A-Za-z0-9*_\-]{3,}")
_ACCOUNT_UUID = re.compile(
    r"(?i)\b((?:organization|organisation|project|account|workspace)'?s?\W{1,4})"
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
)
ACCOUNT_ID_MASK = "[account id]"


def without_account_ids(message: str) -> str:
    """``message`` with the deployment's account ids masked (``_ACCOUNT_IDS``, ``_ACCOUNT_UUID``)."""
    message = _ACCOUNT_IDS.sub(ACCOUNT_ID_MASK, message)
    return _ACCOUNT_UUID.sub(lambda found: found.group(1) + ACCOUNT_ID_MASK, message)


def _error_names(body: Any) -> tuple[list[str], list[str]]:
    """(codes, types) an error body names, most specific first: Anthropic's ``error.details.error_code``,
    then ``error.code``, and ``error.type`` (either wire format: the OpenAI SDK hands over the inner
    error object, Anthropic's the whole body). Only strings: an odd server's list or object there is
    no code (and unhashable)."""
    inner = body.get("error", body) if isinstance(body, Mapping) else None
    if not isinstance(inner, Mapping):
        return [], []
    details = inner.get("details")
    detail = details.get("error_code") if isinstance(details, Mapping) else None
    codes = [c for c in (detail, inner.get("code")) if isinstance(c, str)]
    kind = inner.get("type")
    return codes, [kind] if isinstance(kind, str) else []


def error_code(body: Any) -> str | None:
    """An error body's code, else its type, when it is a short identifier: the one that blames the
    account or the settings when one does (account_exhausted reads it), else the most specific."""
    codes, types = _error_names(body)
    named = [name for name in (*codes, *types) if _CODE.fullmatch(name)]
    blaming = [name for name in named if name in DEPLOYMENT_ERROR_CODES or name in DEPLOYMENT_ERROR_TYPES]
    first = blaming or named
    return first[0] if first else None


def blames_deployment(body: Any, message: str, status: int | None = None) -> bool:
    """Whether an error blames the account or the settings (DEPLOYMENT_ERROR_*), by its error's type or
    codes (Anthropic names the account's and the settings' troubles in ``details.error_code`` under a
    plain invalid_request_error or rate_limit_error), an HTTP 401, 402 or 403 in any vocabulary (a wrong
    key at vLLM or behind a proxy), a 400 naming the output cap's parameter, or the words of Anthropic's
    credit balance and of an output cap over the model's limit."""
    codes, types = _error_names(body)
    if status in (401, 402, 403) or any(c in DEPLOYMENT_ERROR_CODES for c in codes):
        return True
    lowered = message.lower()
    # Not a request too long for the model's context (vLLM names max_tokens then): that one is the
    # request's, as a segment longer than the others is.
    of_the_context = "context" in lowered
    inner = body.get("error", body) if isinstance(body, Mapping) else None
    names_the_cap = isinstance(inner, Mapping) and inner.get("param") in DEPLOYMENT_ERROR_PARAMS
    if status == 400 and names_the_cap and not of_the_context:
        return True
    if any(t in DEPLOYMENT_ERROR_TYPES for t in types):
        return True
    return not of_the_context and any(phrase in lowered for phrase in DEPLOYMENT_ERROR_PHRASES)


def _provider_message(exc: openai.APIStatusError | anthropic.APIStatusError) -> str:
    """The provider's own words (``error.message`` in either wire format); clipped to
    MAX_PROVIDER_MESSAGE_CHARS. A body that is no JSON error (a proxy's HTML page, a server that echoes
    the request) is described, never quoted: the SDKs' own message is that body, and it went into the
    logs, llm_calls, the audit and the job's last error, page text and all."""
    response: Any = getattr(exc, "response", None)

    def described() -> str:  # asked only of a body with no message of its own
        kind = getattr(response, "headers", {}).get("content-type", "no content type") if response else "?"
        size = len(getattr(response, "content", b"") or b"") if response is not None else 0
        return f"{size} bytes, {kind}"

    return body_message(exc.body, described)


def body_message(body: Any, described: str | Callable[[], str]) -> str:
    """An error body's own words (``error.message``, or ``message``, in either wire format), clipped to
    MAX_PROVIDER_MESSAGE_CHARS, the account's ids masked (``without_account_ids``); a body that is no JSON
    error is ``described``, never quoted (a proxy's page, a server echoing the request: page text and
    all)."""
    message: str | None = None
    if isinstance(body, Mapping):
        inner = body.get("error")
        if isinstance(inner, Mapping) and isinstance(inner.get("message"), str):
            message = str(inner["message"])
        elif isinstance(body.get("message"), str):
            message = str(body["message"])
    if message is None:
        what = described() if callable(described) else described
        message = f"a reply that is not a JSON error ({what}; not kept)"
    message = without_account_ids(message)
    if len(message) > MAX_PROVIDER_MESSAGE_CHARS:
        message = message[: MAX_PROVIDER_MESSAGE_CHARS - 1] + "…"
    return message


SDKS = ("openai", "anthropic")
# The SDKs ride on httpx or its fork httpx2: their own exceptions wrap these, but a raw one may escape.
HTTP_LIBRARIES = ("httpx", "httpx2")


def _loaded_errors(modules: tuple[str, ...], name: str) -> tuple[type[BaseException], ...]:
    """The exception class ``name`` of each of ``modules`` that this process has imported. A library
    that was never imported has raised nothing, so it is not imported here: each SDK takes seconds to
    load, and a process that talks to one provider (or none) should not pay for the others."""
    found = (getattr(sys.modules.get(module), name, None) for module in modules)
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException))


def classify(exc: BaseException) -> Classification:
    """Sort an SDK or transport exception into retry (429, 408, 5xx, 529, timeouts, connection) or fail."""
    if isinstance(exc, LLMError):
        return Classification(
            exc.retryable,
            exc.status,
            exc.retry_after,
            str(exc),
            exc.deployment_fault,
            exc.code,
            exc.unreachable,
            exc.too_large,
        )
    # A connect that timed out (a host that drops connections: a dropped route, a firewall) reached no
    # provider, as a refused one reaches none: an outage, not the call's own timeout. The SDKs wrap it.
    never_connected = _loaded_errors(HTTP_LIBRARIES, "ConnectTimeout")
    if isinstance(exc, never_connected) or isinstance(exc.__cause__, never_connected):
        return Classification(True, None, None, f"could not reach the provider: {exc}", unreachable=True)
    timeouts = (*_loaded_errors(SDKS, "APITimeoutError"), *_loaded_errors(HTTP_LIBRARIES, "TimeoutException"))
    if isinstance(exc, timeouts):
        return Classification(True, None, None, f"the provider timed out: {exc}")
    unreachable = (
        *_loaded_errors(SDKS, "APIConnectionError"),
        *_loaded_errors(HTTP_LIBRARIES, "TransportError"),
    )
    if isinstance(exc, unreachable):
        return Classification(True, None, None, f"could not reach the provider: {exc}", unreachable=True)
    if isinstance(exc, _loaded_errors(SDKS, "APIStatusError")):
        exc = cast("openai.APIStatusError | anthropic.APIStatusError", exc)
        status = exc.status_code
        message = _provider_message(exc)
        headers = _headers(exc)
        return _status_classification(
            status,
            exc.body,
            f"HTTP {status}: {message}",
            retry_after_seconds(headers),
            _told_to_retry(headers),
        )
    return Classification(False, None, None, f"{type(exc).__name__}: {exc}")


def _worth_another_try(status: int) -> bool:
    """Whether a status says the provider could not serve now (RETRYABLE_STATUS or any 5xx)."""
    return status in RETRYABLE_STATUS or status >= 500


def _told_to_retry(headers: Mapping[str, str] | None) -> bool | None:
    """The provider's own word on trying again (``x-should-retry: true|false``), which both SDKs obey
    over the status; None when it says nothing."""
    said = (headers or {}).get("x-should-retry", "").strip().lower()
    return True if said == "true" else False if said == "false" else None


def _status_classification(
    status: int | None,
    body: Any,
    message: str,
    retry_after: float | None = None,
    told_to_retry: bool | None = None,
) -> Classification:
    """An error reply's classification by its status (None: an error named without one, which the
    provider met serving the call: tried again), the provider's x-should-retry, and body."""
    blamed = blames_deployment(body, message, status)
    by_status = status is None or _worth_another_try(status)
    # A 429 for a request larger than the whole per-minute limit is no throttling either: it waited out
    # five tries, then its job the outage patience (a day), sending it again each time.
    too_large = status == 429 and "request too large" in message.lower()
    # A 429 that blames the account (OpenAI's insufficient_quota) is no throttling: waiting does not
    # refill the quota, and each call's tries only added to the outage.
    retryable = (by_status if told_to_retry is None else told_to_retry) and not blamed and not too_large
    return Classification(
        retryable, status, retry_after, message, blamed, error_code(body), too_large=too_large
    )


# An error a 200 reply names by a word, not a number: the provider's trouble, worth another try.
SERVER_TROUBLE_CODES = frozenset(
    {"server_error", "internal_error", "internal_server_error", "overloaded", "overloaded_error", "timeout"}
)


class ErrorInReply(LLMError):
    """An error a successful (HTTP 200) reply held instead of its answer. Its log line names the status
    or code only: the provider's words (which may quote the request, page text and all) stay in
    llm_calls and the audit, as an HTTP error's do."""

    @property
    def log_text(self) -> str:
        named = f"HTTP {self.status}" if self.status else "an error"
        return f"{named} in a 200 reply" + (f" ({self.code})" if self.code else "")


def error_in_reply(body: Any, latency_ms: int, usage: Usage | None = None) -> LLMError | None:
    """The error a successful (HTTP 200) reply holds instead of its answer, as gateways such as
    OpenRouter send one met once the model began ({"error": {"code": 502, "message": ...}}); None for
    any other reply. Read as the shape it lacked, it was permanent and its words lost: an upstream 502
    or 429 was never tried again. A code that is a word is tried again only when it names the server's
    trouble (SERVER_TROUBLE_CODES); ``usage`` is what the reply billed, when it says (a body with no usage
    billed none: read as zero, a gateway's storm kept each try's output cap charged in the rate limiter)."""
    if not isinstance(body, Mapping) or "choices" in body or not isinstance(body.get("error"), Mapping):
        return None
    code = body["error"].get("code")
    if isinstance(code, str) and code.strip().isascii() and code.strip().isdigit():
        code = int(code.strip())
    status = code if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599 else None
    message = body_message(body, "an error without a message")
    shown = f"HTTP {status} (in a 200 reply): {message}" if status else f"an error in a 200 reply: {message}"
    c = _status_classification(status, body, shown)
    retryable = c.retryable and (status is not None or c.code in SERVER_TROUBLE_CODES)
    return ErrorInReply(
        made_storable(c.message),
        retryable=retryable,
        status=c.status,
        latency_ms=latency_ms,
        deployment_fault=c.deployment_fault,
        code=c.code,
        usage=usage if body.get("usage") else None,  # none said: none billed (zero kept the cap charged)
        too_large=c.too_large,
    )


def to_llm_error(exc: BaseException, latency_ms: int = 0) -> LLMError:
    if isinstance(exc, LLMError):  # classified already (its kind, e.g. ErrorInReply, kept)
        return exc
    c = classify(exc)
    # The provider's words are stored (llm_calls, the audit, the job): a NUL in them failed that commit.
    return LLMError(
        made_storable(c.message),
        retryable=c.retryable,
        status=c.status,
        retry_after=c.retry_after,
        latency_ms=latency_ms,
        deployment_fault=c.deployment_fault,
        code=c.code,
        unreachable=c.unreachable,
        too_large=c.too_large,
    )
