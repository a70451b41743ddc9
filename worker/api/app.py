"""The HTTP API: signed page webhooks, jobs, facts, config (kill switches), health and metrics.

Every request does a little database work and answers; the LLM work happens on the Celery
queues. A webhook stores its pages and jobs in one transaction and hands the job ids to the
broker only after that transaction committed (``worker.jobs.enqueue``), so a worker never
looks for a row that is not there yet, and a broker outage loses nothing (the sweeper re-sends).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from models import (
    JOB_STATUSES,
    SEGMENT_OUTCOMES,
    ConfigEntry,
    ExtractionAudit,
    Fact,
    Job,
    LLMCall,
    Page,
    WebhookDelivery,
)
from worker.api.signing import SIGNATURE_HEADER, SignatureError, verify
from worker.config_store import KILL_SWITCHES, is_enabled, set_config
from worker.jobs import outbox as jobs
from worker.jobs import queries
from worker.jobs.registry import kind_names
from worker.pages import PageIn, store_page
from worker.runtime import Runtime
from worker.settings import Settings

logger = logging.getLogger(__name__)

MAX_PAGES_PER_REQUEST = 1000
IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY_LENGTH = 255
MAX_LISTED_PROBLEMS = 20
READY_TIMEOUT_SECONDS = 2.0
METRICS_STATEMENT_TIMEOUT = "5s"
# llm_calls.latency_ms buckets for the latency histogram, in milliseconds.
LLM_LATENCY_BUCKETS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000)

JobStatus = Literal["queued", "running", "paused", "succeeded", "failed"]  # = models.JOB_STATUSES
JobKind = Literal["extraction", "compaction", "calibration"]  # = worker.jobs.JOB_KINDS

TAGS = [
    {"name": "pages", "description": "Signed webhooks that store pages and queue their extraction."},
    {"name": "jobs", "description": "The job history: status, counters, errors; retry."},
    {"name": "facts", "description": "Facts extracted from a page (audit rows are never returned)."},
    {"name": "config", "description": "Kill switches and tunables (bearer FACTMILL_ADMIN_TOKEN)."},
    {"name": "search", "description": "Intent-aware search over facts: lex, vec and hyde lines, fused."},
    {"name": "transcripts", "description": "Agent transcripts and their gated compaction summaries."},
    {"name": "calibration", "description": "Feedback on summaries and the calibrated coverage threshold."},
    {"name": "operations", "description": "Liveness, readiness and Prometheus metrics."},
]


def _version() -> str:
    try:
        return importlib.metadata.version("factmill")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return "0.0.0"


# ---------------------------------------------------------------------------
# Errors: always JSON {"detail": ...}, never a stack trace.
# ---------------------------------------------------------------------------


class ApiError(Exception):
    """An error the client caused (or can act on); becomes ``{"detail": ..., **extra}``."""

    def __init__(
        self, status_code: int, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail
        self.headers = headers
        self.extra = extra


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse({"detail": exc.detail, **exc.extra}, exc.status_code, headers=exc.headers)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)


def _location(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc) or "body"


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [{"loc": _location(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in exc.errors()]
    return JSONResponse({"detail": _summarize(problems), "errors": problems}, 422)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": "internal error; the server log has the details"}, 500)


def _summarize(problems: list[dict[str, str]]) -> str:
    shown = "; ".join(f"{p['loc']}: {p['msg']}" for p in problems[:MAX_LISTED_PROBLEMS])
    if len(problems) > MAX_LISTED_PROBLEMS:
        shown += f" (and {len(problems) - MAX_LISTED_PROBLEMS} more)"
    return shown


class ErrorOut(BaseModel):
    detail: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorOut} for code in codes}


# ---------------------------------------------------------------------------
# Per-app context.
# ---------------------------------------------------------------------------


@dataclass
class ApiContext:
    runtime: Runtime
    sender: jobs.Sender | None
    registry: CollectorRegistry
    _broker_url: str | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def factory(self) -> sessionmaker[Session]:
        return self.runtime.factory

    def broker_url(self) -> str:
        if self._broker_url is None:
            from worker.celery_app import broker_url

            # Resolved once: with no FACTMILL_BROKER_URL this starts (or finds) the embedded Redis.
            self._broker_url = broker_url(self.settings)
        return self._broker_url

    def enqueue(self, pairs: list[tuple[int, str]]) -> int:
        return jobs.enqueue(self.factory, pairs, self.sender) if pairs else 0


def _context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.factmill
    return ctx


Context = Annotated[ApiContext, Depends(_context)]


def celery_sender_for(settings: Settings) -> jobs.Sender:
    """A sender over a Celery app configured from ``settings`` (not the process-wide settings)."""
    from worker.celery_app import create_app as create_celery_app

    celery = create_celery_app(settings)  # configured lazily: no broker connection until the first send

    def send(task_name: str, job_id: int, queue: str) -> None:
        celery.send_task(task_name, args=[job_id], queue=queue)

    return send


# ---------------------------------------------------------------------------
# POST /v1/pages: the signed webhook.
# ---------------------------------------------------------------------------


class JobAccepted(BaseModel):
    job_id: int
    source_id: str
    slug: str
    created: bool  # False: a pending job for this page already existed and will read the new content


class PageRef(BaseModel):
    source_id: str
    slug: str


class PagesAccepted(BaseModel):
    jobs: list[JobAccepted]
    unchanged: list[PageRef]


def _pages_body_schema() -> dict[str, Any]:
    page = PageIn.model_json_schema()
    pages = {"type": "array", "items": page, "minItems": 1, "maxItems": MAX_PAGES_PER_REQUEST}
    return {
        "oneOf": [
            page,
            pages,
            {
                "type": "object",
                "properties": {"pages": pages},
                "required": ["pages"],
                "additionalProperties": False,
            },
        ]
    }


def _too_large(cap: int) -> ApiError:
    return ApiError(
        413, f"request body is over the {cap}-byte limit; send fewer or smaller pages per request"
    )


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


def load_json_body(body: bytes) -> Any:
    """A request body as JSON, or a 422 that says what is wrong with it (shared by every signed route)."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as exc:
        raise ApiError(422, f"body is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ApiError(
            422, f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise ApiError(422, "body is not usable JSON: it is nested too deeply") from None
    return data


def parse_pages(body: bytes) -> list[PageIn]:
    """The pages in a webhook body: one page object, a list of them, or ``{"pages": [...]}``."""
    data = load_json_body(body)

    batch = True
    if isinstance(data, list):
        items = data
    elif isinstance(data, dict) and "pages" in data:
        others = sorted(set(data) - {"pages"})
        if others:
            raise ApiError(422, f"unexpected field(s) next to 'pages': {', '.join(others)}")
        items = data["pages"]
        if not isinstance(items, list):
            raise ApiError(422, "pages: must be a list of page objects")
    elif isinstance(data, dict):
        items, batch = [data], False
    else:
        raise ApiError(422, 'body must be a page object, a list of pages, or {"pages": [...]}')
    if not items:
        raise ApiError(422, "pages: the list is empty; send at least one page")
    if len(items) > MAX_PAGES_PER_REQUEST:
        raise ApiError(
            422,
            f"pages: {len(items)} pages in one request; send at most {MAX_PAGES_PER_REQUEST} per request",
        )

    pages: list[PageIn] = []
    problems: list[dict[str, str]] = []
    for index, item in enumerate(items):
        try:
            pages.append(PageIn.model_validate(item))
        except ValidationError as exc:
            prefix = f"pages[{index}]" if batch else ""
            for error in exc.errors(include_url=False):
                where = ".".join(part for part in (prefix, _location(error["loc"])) if part)
                if not error["loc"]:
                    where = prefix or "body"
                problems.append({"loc": where, "msg": error["msg"]})
    if problems:
        raise ApiError(422, _summarize(problems), errors=problems[:100])
    return pages


def _replay(delivery: WebhookDelivery, body_hash: str) -> dict[str, Any]:
    if not hmac.compare_digest(delivery.body_hash, body_hash):
        raise ApiError(422, f"{IDEMPOTENCY_HEADER} reused with a different body; use a new key per delivery")
    return dict(delivery.response)


def store_pages(
    factory: sessionmaker[Session], pages: list[PageIn], key: str | None, body_hash: str
) -> tuple[dict[str, Any], list[tuple[int, str]], bool]:
    """Upsert the pages and request their jobs in ONE transaction.

    Returns (response, jobs to enqueue after the commit, replayed). A repeated delivery with the
    same Idempotency-Key returns the stored response and changes nothing.
    """
    # Lock pages in a fixed order so two overlapping batches cannot deadlock; answer in request order.
    order = sorted(range(len(pages)), key=lambda i: (pages[i].source_id, pages[i].slug))
    results: list[jobs.JobRequest | None] = [None] * len(pages)
    try:
        with factory.begin() as session:
            if key is not None:
                prior = session.get(WebhookDelivery, key)
                if prior is not None:
                    return _replay(prior, body_hash), [], True
            for index in order:
                results[index] = store_page(session, pages[index])
            response = {
                "jobs": [
                    {"job_id": r.job_id, "source_id": p.source_id, "slug": p.slug, "created": r.created}
                    for p, r in zip(pages, results, strict=True)
                    if r is not None
                ],
                "unchanged": [
                    {"source_id": p.source_id, "slug": p.slug}
                    for p, r in zip(pages, results, strict=True)
                    if r is None
                ],
            }
            if key is not None:
                session.add(WebhookDelivery(idempotency_key=key, body_hash=body_hash, response=response))
                session.flush()
    except IntegrityError:
        # A concurrent delivery with the same key committed first: answer what it answered.
        if key is None:
            raise
        with factory() as session:
            prior = session.get(WebhookDelivery, key)
            if prior is None:
                raise
            return _replay(prior, body_hash), [], True
    pending = list(dict.fromkeys((r.job_id, jobs.EXTRACTION) for r in results if r is not None))
    return response, pending, False


def _check_idempotency_key(key: str | None) -> str | None:
    if key is None:
        return None
    cleaned = key.strip()
    if not cleaned or len(cleaned) > MAX_IDEMPOTENCY_KEY_LENGTH or not cleaned.isprintable():
        raise ApiError(
            422, f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable characters"
        )
    return cleaned


def verify_signature(ctx: ApiContext, body: bytes, signature: str | None) -> None:
    """The webhook signature check every signed route runs first: 401 with the reason."""
    settings = ctx.settings
    try:
        verify(signature, body, settings.webhook_secret, settings.webhook_tolerance_seconds)
    except SignatureError as exc:
        raise ApiError(401, exc.reason) from None


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 past ``cap``: at once when the declared length says so, else as soon as
    the stream passes it (the declared length may be absent, chunked, or wrong)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "Content-Length must be a non-negative integer")
        if int(declared) > cap:
            raise _too_large(cap)
    return await _read_capped(request, cap)


def accept_pages(ctx: ApiContext, body: bytes, signature: str | None, key: str | None) -> JSONResponse:
    """Verify, parse, store, commit, then enqueue (runs on a worker thread: all of it blocks)."""
    verify_signature(ctx, body, signature)
    key = _check_idempotency_key(key)
    pages = parse_pages(body)
    body_hash = hashlib.sha256(body).hexdigest()
    response, pending, replayed = store_pages(ctx.factory, pages, key, body_hash)
    if replayed:
        logger.info("replayed webhook delivery %s", key)
        return JSONResponse(response, 202, headers={"Idempotent-Replayed": "true"})
    sent = ctx.enqueue(pending)
    logger.info(
        "accepted %s page(s): %s job(s), %s unchanged, %s sent to the broker",
        len(pages),
        len(response["jobs"]),
        len(response["unchanged"]),
        sent,
    )
    return JSONResponse(response, 202)


pages_router = APIRouter(tags=["pages"])


@pages_router.post(
    "/v1/pages",
    status_code=202,
    response_model=PagesAccepted,
    summary="Store pages and queue their extraction (signed webhook)",
    responses=_errors(400, 401, 413, 422),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": _pages_body_schema()}}}
    },
)
async def post_pages(
    request: Request,
    ctx: Context,
    factmill_signature: Annotated[
        str | None,
        Header(
            alias=SIGNATURE_HEADER,
            description="t=<unix seconds>,v1=<hex HMAC-SHA256 of '<t>.<body>'> under FACTMILL_WEBHOOK_SECRET",
        ),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        Header(alias=IDEMPOTENCY_HEADER, description="A repeated delivery with this key replays the answer"),
    ] = None,
) -> Response:
    """One page, a list of pages, or `{"pages": [...]}` (at most 1,000). Unchanged pages queue nothing."""
    body = await read_body(request, ctx.settings.max_body_bytes)
    return await run_in_threadpool(accept_pages, ctx, body, factmill_signature, idempotency_key)


# ---------------------------------------------------------------------------
# Jobs.
# ---------------------------------------------------------------------------


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    subject: str
    source_id: str | None = None  # page jobs (extraction) only
    slug: str | None = None
    status: str
    attempts: int
    options: dict[str, Any]
    counters: dict[str, Any]
    last_error: str | None
    rerun_requested: bool
    worker: str | None
    created_at: datetime
    updated_at: datetime
    enqueued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None

    @classmethod
    def of(cls, job: Job) -> JobOut:
        out = cls.model_validate(job)
        if job.kind == jobs.EXTRACTION:
            out.source_id, out.slug = jobs.split_page_subject(job.subject)
        return out


class JobList(BaseModel):
    jobs: list[JobOut]


jobs_router = APIRouter(tags=["jobs"])
JobId = Annotated[int, Path(ge=1, description="The job id the webhook answered with")]


@jobs_router.get("/v1/jobs", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    ctx: Context,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status")] = None,
    kind: Annotated[JobKind | None, Query(description="Only jobs of this kind")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before_id: Annotated[int | None, Query(ge=1, description="Only jobs with a smaller id (paging)")] = None,
) -> JobList:
    with ctx.factory() as session:
        found = queries.list_jobs(session, status=status, kind=kind, limit=limit, before_id=before_id)
        return JobList(jobs=[JobOut.of(job) for job in found])


@jobs_router.get("/v1/jobs/{job_id}", response_model=JobOut, responses=_errors(404), summary="One job")
def get_job(ctx: Context, job_id: JobId) -> JobOut:
    with ctx.factory() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id}")
        return JobOut.of(job)


@jobs_router.post(
    "/v1/jobs/{job_id}/retry",
    status_code=202,
    response_model=JobOut,
    responses=_errors(404, 409),
    summary="Queue a failed, paused or succeeded job again",
)
def retry(ctx: Context, job_id: JobId) -> JobOut:
    """A failed, paused or succeeded job is queued again (attempts reset) and sent to its queue.

    A queued or running job is left alone and answered with 409: it is already on its way (and
    the sweeper re-sends a queued job whose message was lost), so a retry would only duplicate it.
    """
    try:
        with ctx.factory.begin() as session:
            out = JobOut.of(queries.retry(session, job_id))
    except queries.JobNotFoundError as exc:
        raise ApiError(404, str(exc)) from None
    except queries.JobNotRetryableError as exc:
        raise ApiError(409, str(exc)) from None
    except queries.JobAlreadyPendingError as exc:
        raise ApiError(409, str(exc), pending_job_id=exc.pending_job_id) from None
    ctx.enqueue([(out.id, out.kind)])
    logger.info("job %s re-queued by the API", job_id)
    return out


# ---------------------------------------------------------------------------
# Facts.
# ---------------------------------------------------------------------------


class FactOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    row_num: int
    fact: str
    kind: str
    entity_slug: str | None
    confidence: float
    notability: str
    context: str
    valid_from: datetime | None
    source: str
    source_session: str
    claim_metric: str | None
    claim_value: float | None
    claim_unit: str | None
    claim_period: str | None
    created_at: datetime


class PageFacts(BaseModel):
    source_id: str
    slug: str
    page_id: int
    total: int
    facts: list[FactOut]


facts_router = APIRouter(tags=["facts"])


@facts_router.get(
    "/v1/pages/{source_id}/{slug:path}/facts",
    response_model=PageFacts,
    responses=_errors(404),
    summary="The facts extracted from one page, in row order",
)
def page_facts(
    ctx: Context,
    source_id: str,
    slug: str,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> PageFacts:
    with ctx.factory() as session:
        page_id = session.scalar(select(Page.id).where(Page.source_id == source_id, Page.slug == slug))
        if page_id is None:
            raise ApiError(404, f"no page {slug!r} in source {source_id!r}")
        # Audit rows (the terminal EXTRACTION_COMPLETE marker) are bookkeeping, never facts.
        where = (Fact.source_id == source_id, Fact.source_markdown_slug == slug, Fact.is_audit.is_(False))
        total = session.scalar(select(func.count()).select_from(Fact).where(*where)) or 0
        rows = session.scalars(select(Fact).where(*where).order_by(Fact.row_num).offset(offset).limit(limit))
        facts = [FactOut.model_validate(f) for f in rows]
    return PageFacts(source_id=source_id, slug=slug, page_id=page_id, total=total, facts=facts)


# ---------------------------------------------------------------------------
# Config (kill switches), behind the admin bearer token.
# ---------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="FACTMILL_ADMIN_TOKEN")


def require_admin(
    ctx: Context, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    challenge = {"WWW-Authenticate": "Bearer"}
    token = ctx.settings.admin_token
    if not token:
        raise ApiError(401, "the admin API is disabled: FACTMILL_ADMIN_TOKEN is not set", headers=challenge)
    if credentials is None:
        raise ApiError(401, "missing 'Authorization: Bearer <admin token>' header", headers=challenge)
    if not hmac.compare_digest(credentials.credentials.encode("utf-8"), token.encode("utf-8")):
        raise ApiError(401, "wrong admin token", headers=challenge)


class ConfigOut(BaseModel):
    key: str
    value: str | None  # None: never set (a kill switch then means enabled)
    enabled: bool | None = None  # kill switches only: what workers act on
    updated_at: datetime | None = None
    updated_by: str | None = None


class ConfigSet(BaseModel):
    value: str | bool | int


class ConfigSetOut(ConfigOut):
    resumed: int = 0  # paused jobs queued again because their kill switch was turned on


def _config_out(session: Session, key: str) -> ConfigOut | None:
    entry = session.get(ConfigEntry, key)
    if entry is None:
        if key in KILL_SWITCHES:
            return ConfigOut(key=key, value=None, enabled=True)
        return None
    return ConfigOut(
        key=key,
        value=entry.value,
        enabled=is_enabled(entry.value) if key in KILL_SWITCHES else None,
        updated_at=entry.updated_at,
        updated_by=entry.updated_by,
    )


config_router = APIRouter(tags=["config"], dependencies=[Depends(require_admin)])
ConfigKey = Annotated[str, Path(min_length=1, max_length=200, description="e.g. facts.extraction_enabled")]


@config_router.get("/v1/config/{key}", response_model=ConfigOut, responses=_errors(401, 404))
def get_config_value(ctx: Context, key: ConfigKey) -> ConfigOut:
    with ctx.factory() as session:
        out = _config_out(session, key)
    if out is None:
        raise ApiError(404, f"config key {key!r} is not set")
    return out


@config_router.put("/v1/config/{key}", response_model=ConfigSetOut, responses=_errors(401, 422))
def put_config_value(ctx: Context, key: ConfigKey, body: ConfigSet) -> ConfigSetOut:
    """Set a key. Turning a kill switch on resumes every paused job of its kinds.

    Turning one off needs nothing more: workers read the switch before every LLM call (through
    a cache at most FACTMILL_CONFIG_CACHE_SECONDS old) and pause their jobs themselves.
    """
    raw = body.value
    value = str(raw).lower() if isinstance(raw, bool) else str(raw)
    with ctx.factory() as session, session.begin():
        try:
            cleaned = set_config(session, key, value, updated_by="api")
        except ValueError as exc:
            raise ApiError(422, f"value: {exc}") from None
        resumed = jobs.resume_for_config_change(session, key, cleaned)
        session.flush()
        out = _config_out(session, key)
        assert out is not None
    ctx.enqueue(resumed)
    logger.info("config %s set to %r by the API; %s paused job(s) resumed", key, cleaned, len(resumed))
    return ConfigSetOut(**out.model_dump(), resumed=len(resumed))


# ---------------------------------------------------------------------------
# Health, readiness, metrics.
# ---------------------------------------------------------------------------

ops_router = APIRouter(tags=["operations"])


def _short(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def ping_database(factory: sessionmaker[Session]) -> None:
    with factory() as session:
        session.execute(text("SELECT 1"))


def ping_broker(url: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    """Raise unless the broker answers within ``timeout`` seconds."""
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss", "redis+socket", "unix"):
        import redis

        if scheme == "redis+socket":  # kombu's spelling of a Unix socket (the embedded Redis)
            path = url.partition("://")[2]
            client = redis.Redis(
                unix_socket_path=path, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        else:
            client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
        return
    from kombu import Connection

    with Connection(url, connect_timeout=timeout) as conn:
        conn.ensure_connection(max_retries=1)


@ops_router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@ops_router.get("/readyz", summary="The database and the broker answer", responses=_errors(503))
def readyz(ctx: Context) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        ping_database(ctx.factory)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = _short(exc)
    try:
        ping_broker(ctx.broker_url())
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = _short(exc)
    failed = [name for name, state in checks.items() if state != "ok"]
    if failed:
        detail = "not ready: " + "; ".join(f"{name} unreachable ({checks[name]})" for name in failed)
        logger.warning(detail)
        return JSONResponse({"detail": detail, "checks": checks}, 503)
    return JSONResponse({"status": "ready", "checks": checks}, 200)


STORE_UP_HELP = "1 if the metrics query reached Postgres"


class StoreCollector:
    """Prometheus collector that reads the job, fact, segment and LLM tables at scrape time.

    Postgres is the source of truth, so the numbers are the same whichever API replica is
    scraped and survive restarts; there is no in-process counter to keep in step.
    """

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory

    def describe(self) -> list[Metric]:
        return []  # keeps registration from querying the database

    def collect(self) -> list[Metric]:
        try:
            return self._collect()
        except Exception as exc:
            logger.warning("metrics: could not read the store: %s", _short(exc))
            return [GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=0)]

    def _collect(self) -> list[Metric]:
        with self.factory() as session, session.begin():
            session.execute(text(f"SET LOCAL statement_timeout = '{METRICS_STATEMENT_TIMEOUT}'"))
            job_rows = session.execute(
                select(Job.status, Job.kind, func.count()).group_by(Job.status, Job.kind)
            ).all()
            facts = session.scalar(select(func.count()).select_from(Fact).where(Fact.is_audit.is_(False)))
            segment_rows = session.execute(
                select(ExtractionAudit.outcome, func.count()).group_by(ExtractionAudit.outcome)
            ).all()
            llm_rows = session.execute(
                select(
                    LLMCall.purpose,
                    LLMCall.outcome,
                    func.count(),
                    func.coalesce(func.sum(LLMCall.input_tokens), 0),
                    func.coalesce(func.sum(LLMCall.output_tokens), 0),
                    func.coalesce(func.sum(LLMCall.cost_usd), 0),
                ).group_by(LLMCall.purpose, LLMCall.outcome)
            ).all()
            latency_rows = session.execute(
                select(
                    LLMCall.purpose,
                    *[func.count().filter(LLMCall.latency_ms <= bound) for bound in LLM_LATENCY_BUCKETS_MS],
                    func.count(),
                    func.coalesce(func.sum(LLMCall.latency_ms), 0),
                ).group_by(LLMCall.purpose)
            ).all()
            job_counts = {(status, kind): n for status, kind, n in job_rows}

        up = GaugeMetricFamily("factmill_store_up", STORE_UP_HELP, value=1)
        jobs_gauge = GaugeMetricFamily("factmill_jobs", "Jobs by status and kind", labels=["status", "kind"])
        kinds = sorted(set(kind_names()) | {kind for _, kind in job_counts})
        for status in JOB_STATUSES:
            for kind in kinds:  # zeros included, so a series never vanishes when its last job moves on
                jobs_gauge.add_metric([status, kind], job_counts.get((status, kind), 0))
        facts_gauge = GaugeMetricFamily(
            "factmill_facts", "Facts stored (audit rows excluded)", value=facts or 0
        )

        segments = CounterMetricFamily(
            "factmill_segments", "Segment extraction attempts by outcome", labels=["outcome"]
        )
        seen = dict(segment_rows)
        for outcome in sorted(set(SEGMENT_OUTCOMES) | set(seen)):
            segments.add_metric([outcome], seen.get(outcome, 0))

        calls = CounterMetricFamily(
            "factmill_llm_calls", "LLM calls by outcome", labels=["purpose", "outcome"]
        )
        tokens = CounterMetricFamily(
            "factmill_llm_tokens", "LLM tokens by direction", labels=["purpose", "direction"]
        )
        cost = CounterMetricFamily("factmill_llm_cost_usd", "LLM spend in US dollars", labels=["purpose"])
        token_sums: dict[tuple[str, str], int] = {}
        cost_sums: dict[str, float] = {}
        for purpose, outcome, n, tokens_in, tokens_out, spend in llm_rows:
            calls.add_metric([purpose, outcome], n)
            token_sums[(purpose, "in")] = token_sums.get((purpose, "in"), 0) + int(tokens_in)
            token_sums[(purpose, "out")] = token_sums.get((purpose, "out"), 0) + int(tokens_out)
            cost_sums[purpose] = cost_sums.get(purpose, 0.0) + float(spend)
        for (purpose, direction), n in sorted(token_sums.items()):
            tokens.add_metric([purpose, direction], n)
        for purpose, dollars in sorted(cost_sums.items()):
            cost.add_metric([purpose], dollars)

        latency = HistogramMetricFamily(
            "factmill_llm_latency_seconds", "LLM call latency (from llm_calls.latency_ms)", labels=["purpose"]
        )
        for row in latency_rows:
            purpose, *counts = row
            *cumulative, total, total_ms = counts
            buckets = [(str(ms / 1000), n) for ms, n in zip(LLM_LATENCY_BUCKETS_MS, cumulative, strict=True)]
            latency.add_metric([purpose], [*buckets, ("+Inf", total)], sum_value=float(total_ms) / 1000)
        return [up, jobs_gauge, facts_gauge, segments, calls, tokens, cost, latency]


@ops_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(ctx: Context) -> Response:
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestMetricsMiddleware:
    """Counts API requests and their latency by route template (not raw path: bounded labels)."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def record_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - started)


# ---------------------------------------------------------------------------
# The app.
# ---------------------------------------------------------------------------


def create_app(runtime: Runtime | None = None, sender: jobs.Sender | None = None) -> FastAPI:
    """The API over ``runtime`` (default: the process runtime from FACTMILL_* settings).

    ``sender`` receives (task name, job id, queue) after each commit; None sends through Celery
    (the shared app for the process runtime, an app configured from ``runtime.settings`` otherwise).
    """
    if runtime is None:
        from worker.runtime import get_runtime

        runtime = get_runtime()
    elif sender is None:
        sender = celery_sender_for(runtime.settings)
    runtime.settings.check_production_secrets()

    app = FastAPI(
        title="Factmill",
        version=_version(),
        summary="Turn conversation pages into durable, auditable facts with an LLM.",
        description=(
            "Signed webhooks store pages and queue their extraction; Celery workers do the LLM work. "
            f"Sign each webhook body with `{SIGNATURE_HEADER}: t=<unix seconds>,v1=<hex HMAC-SHA256 of "
            "'<t>.<body>'>` under FACTMILL_WEBHOOK_SECRET. Errors are JSON `{\"detail\": ...}`."
        ),
        openapi_tags=TAGS,
    )
    registry = CollectorRegistry(auto_describe=False)
    requests = Counter(
        "factmill_http_requests", "API requests", ["method", "route", "status"], registry=registry
    )
    latency = Histogram(
        "factmill_http_request_duration_seconds",
        "API request latency",
        ["method", "route"],
        registry=registry,
    )
    from worker.api.compaction_routes import CompactionCollector

    registry.register(StoreCollector(runtime.factory))  # type: ignore[arg-type]
    registry.register(CompactionCollector(runtime.factory))  # type: ignore[arg-type]
    ProcessCollector(registry=registry)
    app.state.factmill = ApiContext(runtime=runtime, sender=sender, registry=registry)

    app.add_middleware(RequestMetricsMiddleware, requests=requests, latency=latency)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    from worker.api.calibration_routes import calibration_router  # imports this module: import it late
    from worker.api.compaction_routes import compaction_router
    from worker.api.search_routes import search_router

    for router in (
        pages_router,
        jobs_router,
        facts_router,
        config_router,
        calibration_router,
        search_router,
        compaction_router,
        ops_router,
    ):
        app.include_router(router)
    return app


__all__ = ["MAX_PAGES_PER_REQUEST", "ApiError", "create_app", "parse_pages", "store_pages"]
