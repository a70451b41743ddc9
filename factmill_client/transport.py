"""How a call goes over the wire, for both clients: its request (key, Idempotency-Key, a signature
dated when it is sent), when to send it again, and how its answer becomes a model or an exception.

Retries are this small policy rather than tenacity: the client depends on httpx and pydantic only.
A call is sent again on a connection error, a 429 or a 5xx, with jittered exponential backoff (or the
server's Retry-After). A call whose outcome is unknown (a timeout after sending, a 5xx) is resent only
when that is harmless: reads, PUTs, and the ingestion POSTs, which the server deduplicates by their
Idempotency-Key (made once per call, so every attempt carries the same one). A 429, or a connection
that never opened, means the server did nothing: any call is resent then.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from factmill_client.calls import Call
from factmill_client.errors import error_for, retry_after_seconds, unexpected_response
from factmill_client.signing import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, Secrets, secrets_of, sign

logger = logging.getLogger("factmill_client")

# Errors raised before a request left the client: the server cannot have acted on it.
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Seconds a large body's request may wait at least, to write and to read its answer: a server handles a
# few bodies over 1 MiB at a time (the others wait, unread, FACTMILL_MAX_LARGE_BODIES), so a large page
# upload may wait minutes for its turn. At the client's 30 s it timed out and was sent again, whole, to
# the back of the line (a body the socket buffers held whole waited in the read).
LARGE_BODY_TIMEOUT_SECONDS = 300.0
LARGE_BODY_BYTES = 1024 * 1024  # the server's own line (worker.bodycap.LARGE_BODY_BYTES)


def http_timeout(timeout: float | httpx.Timeout | None) -> httpx.Timeout | float | None:
    """The clients' timeouts: ``timeout`` seconds for everything, but at least
    LARGE_BODY_TIMEOUT_SECONDS to write; an httpx.Timeout (or None: no timeout) is taken as given."""
    if isinstance(timeout, int | float):
        return httpx.Timeout(timeout, write=max(timeout, LARGE_BODY_TIMEOUT_SECONDS))
    return timeout


def _large_body_timeout(http: httpx.Client | httpx.AsyncClient) -> dict[str, float | None]:
    """The client's timeouts with at least LARGE_BODY_TIMEOUT_SECONDS to read the answer and write."""
    current = http.timeout

    def at_least(seconds: float | None) -> float | None:
        return None if seconds is None else max(seconds, LARGE_BODY_TIMEOUT_SECONDS)

    return httpx.Timeout(
        connect=current.connect, read=at_least(current.read), write=at_least(current.write), pool=current.pool
    ).as_dict()


T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class RetryPolicy:
    """When a call is sent again, and how long to wait first."""

    attempts: int = 4  # sends per call, the first included; 1 turns retries off
    backoff: float = 0.25  # seconds before the first resend; doubled for each one after
    max_backoff: float = 8.0
    max_retry_after: float = 60.0  # a longer Retry-After is raised to the caller, not waited out
    statuses: frozenset[int] = field(default=frozenset({408, 429, 500, 502, 503, 504}))

    def pause(self, attempt: int, retry_after: float | None = None) -> float:
        ceiling = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        backoff = ceiling * random.uniform(0.5, 1.0)  # jitter: many clients do not retry in step
        if retry_after is None:
            return backoff
        # "Not before" it, with a little jitter on top (every client a server told "5" came back together
        # at +5 s), and never less than the backoff (a Retry-After of 0, or a date past, sent every
        # attempt within milliseconds).
        return max(retry_after + self.backoff * random.random(), backoff)

    def after_error(self, call: Call[Any], exc: httpx.TransportError, attempt: int) -> float | None:
        """Seconds to wait before resending after a connection error; None to give up."""
        if attempt >= self.attempts:
            return None
        if isinstance(exc, UNSENT_ERRORS) or call.replayable:
            return self.pause(attempt)
        return None

    def after_response(self, call: Call[Any], response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before resending after this answer; None to keep it."""
        status = response.status_code
        if status not in self.statuses or attempt >= self.attempts:
            return None
        retry_after = retry_after_seconds(response.headers)
        if retry_after is not None and retry_after > self.max_retry_after:
            return None
        # 429, and 408 (the body did not arrive in time: no route read it), say the server did nothing.
        if status in (408, 429) or call.replayable:
            return self.pause(attempt, retry_after)
        return None


# How long a call's retries keep the time its first attempt was signed with: well inside the server's
# default tolerance (FACTMILL_WEBHOOK_TOLERANCE_SECONDS, 300), which a retry must meet once its body has
# arrived too (a large one takes a while), and whatever the skew between the two clocks.
REDATE_AFTER_SECONDS = 60.0
_HEADER_SAFE = re.compile(r"[!-~]+")  # visible ASCII: what a Bearer token may hold


@dataclass(frozen=True)
class Credentials:
    api_key: str | None = field(default=None, repr=False)
    webhook_secret: Secrets | None = field(default=None, repr=False)  # several while it is rotated
    clock: Callable[[], float] = field(default=time.time, repr=False)  # dates signatures
    redate_after_seconds: float = REDATE_AFTER_SECONDS

    def __post_init__(self) -> None:
        if not 0 <= self.redate_after_seconds < math.inf:
            given = self.redate_after_seconds
            raise ValueError(f"redate_after_seconds must be 0 or more seconds; got {given}")
        # A key read from a file with its newline: httpx refused the header and quoted it whole in its
        # error, which the client's own ApiConnectionError carried on into whatever logged it.
        if self.api_key and not _HEADER_SAFE.fullmatch(self.api_key):
            raise ValueError(
                "api_key holds whitespace, a control character or a non-ASCII character (read from a "
                "file with its trailing newline?); the key itself is not shown"
            )
        # With no key, an empty secret (an unset variable read as "") sent ingests unsigned, each a 401
        # "missing Factmill-Signature header"; a blank one raised a bare ValueError on the first ingest.
        # (With a key, a blank secret signs nothing, as documented: the key's ingest scope authenticates.)
        blank = isinstance(self.webhook_secret, str) and not self.webhook_secret.strip()
        if self.api_key and blank:
            # (Frozen.) Kept, "\n" was truthy: every signed call raised a bare ValueError as it was signed.
            object.__setattr__(self, "webhook_secret", None)
        elif self.webhook_secret is not None:
            secrets_of(self.webhook_secret)

    def signing_time(self, first: int | None) -> int:
        """When an attempt is signed: the call's first attempt's time, while a server still takes it.
        The server keeps the page of the newest delivery by its signed time: a retry dated anew, after
        another sender stored a newer version of the page meanwhile, looked newer and rolled it back."""
        now = int(self.clock())
        if first is None or now - first > self.redate_after_seconds:
            return now
        return first


def build_request(
    http: httpx.Client | httpx.AsyncClient,
    call: Call[Any],
    credentials: Credentials,
    signed_at: int | None = None,
) -> httpx.Request:
    """The request for one attempt of ``call``. A signed call is signed for each attempt at
    ``signed_at`` (``Credentials.signing_time``; None: now), over the path as sent and the call's
    Idempotency-Key (the same for every attempt; v4)."""
    headers: dict[str, str] = {}
    if call.body is not None:
        headers["Content-Type"] = "application/json"
    if credentials.api_key:
        headers["Authorization"] = f"Bearer {credentials.api_key}"
    if call.idempotency_key is not None:
        headers[IDEMPOTENCY_HEADER] = call.idempotency_key
    request = http.build_request(
        call.method, call.path, params=call.params, content=call.body, headers=headers
    )
    if call.body is not None and len(call.body) > LARGE_BODY_BYTES:
        request.extensions["timeout"] = _large_body_timeout(http)
    if call.signed and credentials.webhook_secret:
        path = request.url.raw_path.decode("ascii").partition("?")[0]
        request.headers[SIGNATURE_HEADER] = sign(
            call.body or b"",
            credentials.webhook_secret,
            int(credentials.clock()) if signed_at is None else signed_at,
            method=call.method,
            path=path,
            idempotency_key=call.idempotency_key,
        )
    return request


def route_of(path: str) -> str:
    """The path's API group only ("/v1/pages/…"): the rest holds transcript ids, slugs and entity names,
    which can name a person, and the server keeps them out of its own logs too."""
    parts = path.split("/")
    return "/".join(parts[:3]) + "/…" if len(parts) > 3 else path


# The base URLs of this process's clients. httpx logs every request's URL whole at INFO (the level the
# retry lines need), ids, slugs and entity names with it: its lines for these are cut to the route group.
# (A count a base: clients of one base made and closed; under a lock, as clients are made on any thread.)
_BASES: dict[httpx.URL, int] = {}
_BASES_LOCK = threading.Lock()


def _route_only(url: httpx.URL) -> httpx.URL | str:
    with _BASES_LOCK:
        bases = tuple(_BASES)
    for base in bases:
        if (url.scheme, url.netloc) == (base.scheme, base.netloc) and url.path.startswith(base.path):
            prefix = base.path.rstrip("/")
            return f"{url.scheme}://{url.netloc.decode('ascii')}{prefix}{route_of(url.path[len(prefix) :])}"
    return url


class _RoutesOnlyInHttpxLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(arg, httpx.URL) for arg in record.args):
            record.args = tuple(_route_only(a) if isinstance(a, httpx.URL) else a for a in record.args)
        return True


_HTTPX_FILTER = _RoutesOnlyInHttpxLogs()


def routes_only_in_httpx_logs(base_url: httpx.URL) -> Callable[[], None]:
    """httpx's log lines for requests under ``base_url`` name only the route group (``route_of``), until
    the call this returns is made (by the client's close; again, it does nothing)."""
    with _BASES_LOCK:
        _BASES[base_url] = _BASES.get(base_url, 0) + 1
    logging.getLogger("httpx").addFilter(_HTTPX_FILTER)  # (once: a filter already there is not added)
    ended = False

    def end() -> None:
        nonlocal ended
        with _BASES_LOCK:
            if not ended:
                ended = True
                left = _BASES.pop(base_url, 1) - 1
                if left:
                    _BASES[base_url] = left

    return end


def give_up_message(call: Call[Any], exc: Exception, attempt: int) -> str:
    where = route_of(call.path)
    return f"{call.method} {where}: no answer after {attempt} attempt(s): {type(exc).__name__}: {exc}"


def note_retry(call: Call[Any], attempt: int, why: str, pause: float) -> None:
    where = route_of(call.path)
    logger.info("%s %s: attempt %s %s; sending again in %.2f s", call.method, where, attempt, why, pause)


def parse(call: Call[T], response: httpx.Response) -> T:
    """The answer as the call's model, or the exception for its error status."""
    if response.is_success:
        try:
            return call.model.model_validate(response.json())
        except ValueError as exc:  # not JSON, or JSON of another shape (pydantic's error is a ValueError)
            raise unexpected_response(response, f"a {call.model.__name__}", exc) from exc
    raise error_for(response)


__all__ = ["Credentials", "RetryPolicy", "build_request", "give_up_message", "note_retry", "parse"]
