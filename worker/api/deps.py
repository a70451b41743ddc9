"""What every route depends on: the per-app Context, the admin bearer check, the signed-body reader."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, Request
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from worker import celery_app
from worker.access import Principal
from worker.access.ratelimit import InFlightPerKey, PerKeyLimiter
from worker.api.errors import CHALLENGE, ApiError, problems_of, summarize
from worker.api.inputs import strict_json_loads
from worker.bodycap import too_large_detail
from worker.core.labels import clean_label
from worker.core.signing import (
    IDEMPOTENCY_HEADER,
    MAX_IDEMPOTENCY_KEY_LENGTH,
    SignatureError,
    check_header,
    verify,
)
from worker.jobs import sending
from worker.runtime import Runtime
from worker.settings import Settings

MAX_REMEMBERED_KEYS = 64

T = TypeVar("T")

# ---------------------------------------------------------------------------
# Per-app context.
# ---------------------------------------------------------------------------


@dataclass
class ApiContext:
    runtime: Runtime
    sender: sending.Sender | None
    registry: CollectorRegistry
    _broker_url: str | None = field(default=None, repr=False)
    _search_limiter: PerKeyLimiter | None = field(default=None, repr=False)
    _searches_running: InFlightPerKey | None = field(default=None, repr=False)
    # Keys that passed the check, by digest: (principal, when, monotonic), for routes served through a
    # database outage (the metrics scrape: factmill_store_up 0 is what it is for).
    _verified: dict[str, tuple[Principal, float]] = field(default_factory=dict, repr=False)
    _verified_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def factory(self) -> sessionmaker[Session]:
        return self.runtime.factory

    def broker_url(self) -> str:
        if self._broker_url is None:
            # Resolved once: with no FACTMILL_BROKER_URL this starts (or finds) the embedded Redis.
            self._broker_url = celery_app.broker_url(self.settings)
        return self._broker_url

    def remember_key(self, digest: str, principal: Principal) -> None:
        with self._verified_lock:
            self._verified.pop(digest, None)  # re-inserted last: the least recently checked go first
            if len(self._verified) >= MAX_REMEMBERED_KEYS:
                self._verified.pop(next(iter(self._verified)))
            self._verified[digest] = (principal, time.monotonic())

    def forget_key(self, digest: str) -> None:
        with self._verified_lock:
            self._verified.pop(digest, None)

    def remembered_key(self, digest: str, within: float) -> Principal | None:
        """The principal of a key that passed the check less than ``within`` seconds ago."""
        found = self._verified.get(digest)
        return found[0] if found is not None and time.monotonic() - found[1] < within else None

    def search_limiter(self) -> PerKeyLimiter:
        """Searches per minute per key (FACTMILL_SEARCH_RATE_PER_MINUTE), made on first use."""
        if self._search_limiter is None:
            self._search_limiter = PerKeyLimiter.for_runtime(self.runtime)
        return self._search_limiter

    def __post_init__(self) -> None:
        # Made now, not on first use: two first searches at once each made a count of their own.
        self._searches_running = InFlightPerKey(self.settings.search_concurrency_per_key)

    def searches_running(self) -> InFlightPerKey:
        """Searches each key has running in this process (FACTMILL_SEARCH_CONCURRENCY_PER_KEY)."""
        assert self._searches_running is not None
        return self._searches_running

    def enqueue(self, pairs: list[tuple[int, str]]) -> int:
        """Hand (job id, kind) pairs to the broker; call it only after their transaction committed."""
        return sending.enqueue(self.factory, pairs, self.sender) if pairs else 0


async def _context(request: Request) -> ApiContext:
    # async: resolved on the event loop, so an async route (/readyz) never waits for a request thread
    ctx: ApiContext = request.app.state.factmill
    return ctx


Context = Annotated[ApiContext, Depends(_context)]


def celery_sender_for(settings: Settings) -> sending.Sender:
    """A sender over a Celery app configured from ``settings`` (not the process-wide settings)."""
    celery = celery_app.create_app(settings)  # configured lazily: no broker connection until the first send

    def send(task_name: str, job_id: int, queue: str) -> None:
        celery.send_task(task_name, args=[job_id], queue=queue)

    return send


# ---------------------------------------------------------------------------
# Signed bodies: read (capped), verify, parse.
# ---------------------------------------------------------------------------


# clean_label's rule in ASCII: visible characters at either end, printable ones between, spaces around.
ASCII_LABEL_PATTERN = r"^ *[!-~](?:[ -~]*[!-~])? *$"


def idempotency_header(description: str, limit: int = MAX_IDEMPOTENCY_KEY_LENGTH) -> Any:
    """The Idempotency-Key header parameter as the document states it (``check_idempotency_key``)."""
    return Header(
        alias=IDEMPOTENCY_HEADER,
        description=description,
        max_length=limit,
        json_schema_extra={"pattern": ASCII_LABEL_PATTERN},
    )


IdempotencyHeader = Annotated[
    str | None, idempotency_header("A repeated delivery with this key replays the answer")
]


def json_request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its (signed) body itself: the body it documents."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _too_large(cap: int) -> ApiError:
    return ApiError(413, too_large_detail(cap))


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, read as it streams in; stops (413) as soon as it passes ``cap`` bytes."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 past ``cap``: at once when the declared length says so, else as soon as
    the stream passes it (the declared length may be absent, chunked, or wrong); 415 when it is
    compressed (a Content-Encoding other than identity)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Not decoded here: the body was read as it came, and gzip failed as "not UTF-8 (byte 1)".
        raise ApiError(
            415, f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed"
        )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "Content-Length must be a non-negative integer")
        if int(declared) > cap:
            raise _too_large(cap)
    return await _read_capped(request, cap)


def check_signature_header(
    ctx: ApiContext,
    signature: str | None,
    method: str,
    path: str,
    idempotency_key: str | None,
    arrived_at: float | None = None,
) -> None:
    """The body-free part of ``verify_signature`` (401 with the reason), run before the body is read."""
    _signature_checked(ctx, check_header, (signature,), method, path, idempotency_key, arrived_at)


def verify_signature(
    ctx: ApiContext,
    body: bytes,
    signature: str | None,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
    arrived_at: float | None = None,
) -> int:
    """The webhook signature check every signed route runs first: 401 with the reason; returns the
    signed timestamp. With ``method`` and ``path`` the signature must be v4 (bound to them and to
    ``idempotency_key``; without a key only while v2 is accepted), or v3 / v2 / v1 while
    FACTMILL_ACCEPT_V3_SIGNATURES / _V2_ / _V1_ are on. Its age is
    measured at ``arrived_at`` (worker.bodycap.arrived_at; None: now): a large delivery signed when it
    was sent waited unread for a place to be read in, up to the client's patience, and was refused as
    too old once its turn came (the sender's resend, signed at the same time, waited again)."""
    secrets = ctx.settings.webhook_secrets()
    return _signature_checked(
        ctx, verify, (signature, body, secrets), method, path, idempotency_key, arrived_at
    )


def _signature_checked(
    ctx: ApiContext,
    check: Callable[..., T],
    leading: tuple[Any, ...],
    method: str | None,
    path: str | None,
    idempotency_key: str | None,
    arrived_at: float | None,
) -> T:
    """``check`` (the header's check, or the whole one) under the deployment's rules; 401 when it fails."""
    settings = ctx.settings
    try:
        return check(
            *leading,
            settings.webhook_tolerance_seconds,
            now=arrived_at,
            method=method,
            path=path,
            idempotency_key=idempotency_key,
            accept_v3=settings.accept_v3_signatures,
            accept_v2=settings.accept_v2_signatures,
            accept_v1=settings.accept_v1_signatures,
        )
    except SignatureError as exc:  # an ingest key may be sent instead: the challenge says so
        raise ApiError(401, exc.reason, headers=CHALLENGE) from None


def check_idempotency_key(key: str | None) -> str | None:
    """The Idempotency-Key header, stripped; 422 unless it is 1 to MAX_IDEMPOTENCY_KEY_LENGTH printable
    characters."""
    if key is None:
        return None
    cleaned = clean_label(key, MAX_IDEMPOTENCY_KEY_LENGTH)
    # ASCII: a header is bytes, read here as latin-1 ("注文-1" arrived as mojibake holding C1 controls,
    # refused for a reason it did not have; "é" was stored as "Ã©"), as the signing client requires.
    if cleaned is None or not cleaned.isascii():
        raise ApiError(
            422,
            f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters "
            "(a header value is bytes: other text is read differently by each side)",
        )
    return cleaned


def load_json_body(body: bytes) -> Any:
    """A request body as JSON, or a 422 that says what is wrong with it (shared by every route that reads
    a body): strict, so NaN, NUL and lone surrogates are refused with the JSON path that holds them."""
    return strict_json_loads(body)


def load_json_object(body: bytes, expected: str = "a JSON object") -> dict[str, Any]:
    """A request body that must be one JSON object; else 422 ``body must be <expected>``."""
    data = load_json_body(body)
    if not isinstance(data, dict):
        raise ApiError(422, f"body must be {expected}")
    return data


M = TypeVar("M", bound=BaseModel)


def parse_json_model(body: bytes, model: type[M]) -> M:
    """A (capped) body loaded strictly and validated as ``model``; 422 naming each field that is wrong,
    or the fields an object must have (pydantic's word named our class: "instance of ConfigSet")."""
    fields = ", ".join(f'"{name}"' for name in model.model_fields)
    data = load_json_object(body, f"a JSON object with the fields {fields}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = problems_of(exc.errors(include_url=False), ("body",))
        raise ApiError(422, summarize(problems), errors=problems) from None


__all__ = [
    "IDEMPOTENCY_HEADER",
    "ApiContext",
    "Context",
    "IdempotencyHeader",
    "celery_sender_for",
    "check_idempotency_key",
    "idempotency_header",
    "json_request_body",
    "load_json_body",
    "load_json_object",
    "parse_json_model",
    "read_body",
    "verify_signature",
]
