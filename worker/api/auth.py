"""Who is calling, and may they: API keys with scopes (and source limits) as FastAPI dependencies.

Each route declares the scope it needs in its signature (``Reader``, ``Admin``, ``Ingester``...), so
the OpenAPI document shows the security scheme per operation. ``Authorization: Bearer <key>`` carries
a key from ``factmill keys create``, or FACTMILL_ADMIN_TOKEN (the bootstrap admin). Ingestion routes
also take a webhook signature instead, for senders that hold only the shared secret.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from worker.access import Principal, is_admin_token, may_be_a_key, principal_for, refusal
from worker.access.store import hash_key
from worker.api.deps import ApiContext, Context, check_signature_header, verify_signature
from worker.api.errors import CHALLENGE, ApiError
from worker.api.scrape_reads import note_outage, outage_persists, outage_seen
from worker.bodycap import ARRIVED_MONOTONIC_SCOPE_KEY, arrived_at
from worker.core.moments import SAME_SECOND_HINT
from worker.core.signing import (
    EXPECTED_FORMAT,
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
)
from worker.db import database_went_away
from worker.deliveries import WEBHOOK_SENDER, arrival_by_database_clock
from worker.guards import UNAVAILABLE_RETRY_AFTER_SECONDS

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description=(
        "An API key from `factmill keys create` (scopes read, ingest, admin, metrics) or FACTMILL_ADMIN_TOKEN"
    ),
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
# The webhook signature is the ingestion routes' other credential, so the document declares it as a
# security scheme (an alternative to the key), not as a plain header.
_signature = APIKeyHeader(
    name=SIGNATURE_HEADER,
    auto_error=False,
    scheme_name="WebhookSignature",
    description=f"{EXPECTED_FORMAT} under FACTMILL_WEBHOOK_SECRET",
)
SignatureHeader = Annotated[str | None, Depends(_signature)]


def request_path(request: Request) -> str:
    """The path as the sender wrote it (percent-escapes kept, no query string): what v4 (and v3, v2) signs."""
    raw: bytes | None = request.scope.get("raw_path")
    return raw.decode("latin-1").partition("?")[0] if raw else request.url.path


# A key that passed the check this recently is taken on that check while the database is down, on routes
# that serve through an outage (the metrics scrape, which must report factmill_store_up 0: refused
# there, the target went down and the alert on store_up could never fire). A key refused (revoked) is
# forgotten at once; one revoked while the scrape was not looking passes until the grace runs out.
OUTAGE_GRACE_SECONDS = 900.0


def resolve(
    ctx: ApiContext, credentials: HTTPAuthorizationCredentials | None, *, through_outage: bool = False
) -> Principal | None:
    """The principal a bearer credential names; None without one; 401 when it is unknown or revoked.
    ``through_outage``: a key checked within OUTAGE_GRACE_SECONDS passes while the database is down."""
    return _resolved(ctx, credentials, through_outage)[0]


def _resolved(
    ctx: ApiContext, credentials: HTTPAuthorizationCredentials | None, through_outage: bool
) -> tuple[Principal | None, bool]:
    """``resolve``'s principal, and whether the database checked it just now (not a remembered check)."""
    if credentials is None:
        return None, False
    remembered = None
    if through_outage:
        remembered = ctx.remembered_key(hash_key(credentials.credentials), OUTAGE_GRACE_SECONDS)
        if remembered is None:
            _refuse_unlookable(ctx, credentials.credentials)  # again on its thread: queued, it waited
        elif outage_persists(ctx.factory, gone=True):
            # Not asked again while the database is away (gone: not merely out of connections, when it
            # is up and would say the key was revoked): a database that drops packets took the connect
            # timeout (10 s, or a pooled connection's 60) per scrape before the collectors' own reads,
            # past Prometheus's scrape timeout, and factmill_store_up 0 never reached it.
            return remembered, False
    try:
        principal = principal_for(ctx.factory, credentials.credentials, ctx.settings.admin_token)
    except Exception as exc:
        # An outage only (the database unreachable or restarting): not a pool busy past its timeout,
        # nor a server out of connections or disk, which is up and says a key revoked meanwhile is
        # (one was taken for up to the grace); those get the 503 they get anywhere.
        went_away = isinstance(exc, OperationalError) and database_went_away(exc)
        if through_outage and went_away:
            note_outage(ctx.factory, gone=True)  # a key not remembered too: the next are refused at once
        if remembered is None or not went_away:
            raise
        return remembered, False
    if principal is None:
        ctx.forget_key(hash_key(credentials.credentials))  # revoked: no longer taken through an outage
        raise ApiError(401, "unknown or revoked API key (or wrong admin token)", headers=CHALLENGE)
    return principal, True


def _check_scope(principal: Principal, scope: str, all_sources: str | None) -> Principal:
    refused = refusal(principal, scope, all_sources=all_sources)
    if refused is not None:
        raise ApiError(403, refused)
    return principal


@functools.cache
def require(
    scope: str, *, all_sources: str | None = None, through_outage: bool = False
) -> Callable[..., Principal]:
    """A dependency: the caller's principal, 401 without a credential, 403 without ``scope``. With
    ``all_sources`` (what the route serves, e.g. "transcripts") a source-limited key is refused too;
    ``through_outage``: see ``resolve``. One callable per arguments (cached): FastAPI resolves a
    dependency once a request by its callable, so a router's ``require("admin")`` and a handler's
    ``Admin`` check the key once (as two closures, twice: two transactions, and a 503 from the second)."""

    def dependency(ctx: Context, credentials: Credentials) -> Principal:
        principal, checked = _resolved(ctx, credentials, through_outage)
        if principal is None:
            raise ApiError(
                401, f"missing 'Authorization: Bearer <API key>' header (scope {scope!r})", headers=CHALLENGE
            )
        _check_scope(principal, scope, all_sources)
        # Only a key this route lets in, and only on a real check (a remembered one is not renewed: the
        # grace runs from the last time the database said yes).
        if through_outage and checked and credentials is not None:
            ctx.remember_key(hash_key(credentials.credentials), principal)
        return principal

    return dependency


@dataclass(frozen=True)
class Ingest:
    """Who delivers: a key with the ingest scope, or (principal None) a sender holding the webhook
    secret, whose ``signature`` the route verifies once it has the body."""

    principal: Principal | None
    signature: str | None
    method: str
    path: str
    idempotency_key: str | None = None  # the header as sent (surrounding spaces stripped)
    arrived_at: float | None = None  # when the request reached the server (the signature's age is to it)
    arrived_monotonic: float | None = None  # the same moment by time.monotonic() (a keyed one's date)

    def verify(self, ctx: ApiContext, body: bytes) -> int | None:
        """The signed timestamp when a signature was sent (401 unless it signs this method, path,
        body and Idempotency-Key); None for a keyed delivery without one."""
        if self.signature is None:
            return None
        return verify_signature(
            ctx, body, self.signature, self.method, self.path, self.idempotency_key, self.arrived_at
        )

    def delivered_at(self, ctx: ApiContext, body: bytes) -> Callable[[Session], datetime]:
        """``verify``, then how the delivery's transaction dates it: by its signed time, or a keyed one
        by its arrival (when it reached the server, before any wait for a large-body place or its upload:
        dated after its body was read, one sent before an erasure was taken for one sent after it) on
        the database's clock, which dates erasures (worker.deliveries.arrival_by_database_clock)."""
        signed_at = self.verify(ctx, body)
        if signed_at is not None:
            signed = datetime.fromtimestamp(signed_at, UTC)
            return lambda _session: signed
        return functools.partial(arrival_by_database_clock, arrived=self.arrived_monotonic)

    def erased_in_its_second(
        self, in_its_second: bool, hint: str = SAME_SECOND_HINT
    ) -> tuple[str, dict[str, str] | None]:
        """What a 409 for a delivery older than an erasure (or, with ``hint``, than another delivery)
        adds, and its headers: for a signed one it fell in the second of its signature, which is dated
        to the second, to wait one."""
        if in_its_second and self.signature is not None:
            return hint, {"Retry-After": "1"}
        return "", None

    @property
    def sender(self) -> str:
        """Who delivers, for the scope of an Idempotency-Key: the key, else the webhook secret's holder."""
        return WEBHOOK_SENDER if self.principal is None else self.principal.sender

    def check_sources(self, source_ids: Iterable[str]) -> None:
        """403 unless the delivering key may write every one of ``source_ids``."""
        if self.principal is None:
            return
        refused = sorted({s for s in source_ids if not self.principal.sees(s)})
        if refused:
            raise ApiError(403, f"this key may not write source(s) {', '.join(map(repr, refused))}")


def require_ingest(*, all_sources: str | None = None) -> Callable[..., Ingest]:
    """A dependency for ingestion routes: a key with the ingest scope or a signature header that is
    well formed, of a scheme this server checks and fresh (checked here, before the body is read).
    Whatever credential is sent must be valid."""

    def dependency(
        request: Request, ctx: Context, credentials: Credentials, signature: SignatureHeader
    ) -> Ingest:
        principal = resolve(ctx, credentials)
        if principal is not None:
            _check_scope(principal, "ingest", all_sources)
        if signature is None and principal is None:
            raise ApiError(
                401,
                f"missing {SIGNATURE_HEADER} header: sign the request, or send "
                "'Authorization: Bearer <API key>' with the 'ingest' scope",
                headers=CHALLENGE,
            )
        key = request.headers.get(IDEMPOTENCY_HEADER)
        key = key.strip() if key is not None else None
        path = request_path(request)
        arrived = arrived_at(request.scope)
        if signature is not None:
            check_signature_header(ctx, signature, request.method, path, key, arrived)
        since = arrived_at(request.scope, ARRIVED_MONOTONIC_SCOPE_KEY)
        return Ingest(principal, signature, request.method, path, key, arrived, since)

    return dependency


Reader = Annotated[Principal, Depends(require("read"))]
Admin = Annotated[Principal, Depends(require("admin"))]
# The figures cover every source, like the transcripts: a key limited to sources gets 403.
# The scrape is served through a database outage (it reports the outage), and its key is checked on
# threads of its own (as /readyz's probes run): slow searches holding every request thread made the
# scrape time out, every series went stale and the alerts that need them could not fire.
_SCRAPE_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="metrics")
T = TypeVar("T")
_metrics_key = require("metrics", all_sources="the metrics", through_outage=True)


async def on_scrape_threads(work: Callable[[], T]) -> T:
    """``work`` on the scrape's own threads, never on the request threads, in the request's context (its
    request id on the log lines, its span the parent of the database's), as anyio's threads run it."""
    context = contextvars.copy_context()
    return await asyncio.wrap_future(_SCRAPE_THREADS.submit(context.run, work))


async def _metrics_reader(ctx: Context, credentials: Credentials) -> Principal:
    if credentials is None:  # the 401, on the event loop: no lookup to make, no thread to queue for
        return _metrics_key(ctx, None)
    if ctx.remembered_key(hash_key(credentials.credentials), OUTAGE_GRACE_SECONDS) is None:
        _refuse_unlookable(ctx, credentials.credentials)
    return await on_scrape_threads(lambda: _metrics_key(ctx, credentials))


def _refuse_unlookable(ctx: ApiContext, key: str) -> None:
    """503 for a key no scrape checked lately (the caller knows) while the database is seen away: it
    cannot be checked, and each lookup held one of the scrape's two threads for the connect timeout.
    Anyone could send such keys, and the scrape with the real key timed out behind them
    (factmill_store_up 0 unseen). Asked on the event loop and again on the thread, where a request
    queued before the outage was seen would otherwise still wait its timeout. The admin token and what
    has no key's form are told without the database."""
    if (
        may_be_a_key(key)
        and not is_admin_token(key, ctx.settings.admin_token)
        and outage_seen(ctx.factory, gone=True)
    ):
        raise ApiError(
            503,
            "the database is unavailable; try again shortly",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
        )


MetricsReader = Annotated[Principal, Depends(_metrics_reader)]
TranscriptReader = Annotated[Principal, Depends(require("read", all_sources="transcripts"))]
CalibrationReader = Annotated[Principal, Depends(require("read", all_sources="calibration figures"))]
PageIngester = Annotated[Ingest, Depends(require_ingest())]
TranscriptIngester = Annotated[Ingest, Depends(require_ingest(all_sources="transcripts"))]
FeedbackIngester = Annotated[Ingest, Depends(require_ingest(all_sources="calibration feedback"))]

__all__ = [
    "Admin",
    "CalibrationReader",
    "FeedbackIngester",
    "Ingest",
    "PageIngester",
    "Reader",
    "TranscriptIngester",
    "TranscriptReader",
    "request_path",
    "require",
    "require_ingest",
    "resolve",
]
