"""The synchronous client: ``Client(base_url, api_key=..., webhook_secret=...)``.

Each method sends one call of factmill_client.calls and answers its typed model; ``iter_*`` methods
walk a list endpoint page by page. Errors are factmill_client.errors exceptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from factmill_client import calls, models
from factmill_client.errors import ApiConnectionError
from factmill_client.signing import Secrets
from factmill_client.transport import (
    REDATE_AFTER_SECONDS,
    Credentials,
    RetryPolicy,
    build_request,
    give_up_message,
    http_timeout,
    note_retry,
    parse,
    routes_only_in_httpx_logs,
)

T = TypeVar("T", bound=BaseModel)
P = TypeVar("P", bound=BaseModel)
I = TypeVar("I")  # noqa: E741

USER_AGENT = "factmill-client"


class Client:
    """The Factmill HTTP API. ``api_key`` is sent as ``Authorization: Bearer`` on every call;
    ``webhook_secret`` signs the ingestion calls (pages, transcript appends) instead of, or besides, a
    key with the ingest scope; a list of secrets signs with each (while the server's secret is
    rotated). The server checks every credential a call carries: a key sent beside a signature must
    itself hold the ingest scope (a read-only key and the secret in one client get 403 on ingestion;
    use a client without the key to deliver). ``transport`` is handed to httpx (tests, proxies).
    ``redate_after_seconds``: a retry of a signed call keeps its first attempt's signed time for this
    long (the server keeps a page's newest delivery by that time), then is signed anew; keep it below
    the server's FACTMILL_WEBHOOK_TOLERANCE_SECONDS (300 by default), or a retry is refused as too old."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        webhook_secret: Secrets | None = None,
        timeout: float | httpx.Timeout | None = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        redate_after_seconds: float = REDATE_AFTER_SECONDS,
    ) -> None:
        # Checked before the connection pool is made: a refused argument leaves nothing open.
        self._credentials = Credentials(api_key, webhook_secret, clock, redate_after_seconds)
        self._http = httpx.Client(
            base_url=base_url,
            timeout=http_timeout(timeout),
            transport=transport,
            headers={"User-Agent": USER_AGENT},
        )
        self._end_routes_only = routes_only_in_httpx_logs(self._http.base_url)
        self.retry = retry or RetryPolicy()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        self._end_routes_only()

    def send(self, call: calls.Call[T]) -> T:
        """Send ``call`` (retrying as ``self.retry`` says) and answer its model."""
        attempt = 0
        signed_at: int | None = None
        while True:
            attempt += 1
            signed_at = self._credentials.signing_time(signed_at)
            request = build_request(self._http, call, self._credentials, signed_at)
            try:
                response = self._http.send(request)
            except httpx.TransportError as exc:
                pause = self.retry.after_error(call, exc, attempt)
                if pause is None:
                    raise ApiConnectionError(give_up_message(call, exc, attempt)) from exc
                note_retry(call, attempt, f"failed ({type(exc).__name__})", pause)
            except httpx.RequestError as exc:  # an answer that could not be read (its encoding broken)
                raise ApiConnectionError(give_up_message(call, exc, attempt)) from exc
            else:
                pause = self.retry.after_response(call, response, attempt)
                if pause is None:
                    return parse(call, response)
                note_retry(call, attempt, f"answered {response.status_code}", pause)
            time.sleep(pause)

    def iterate(self, paging: calls.Paging[P, I]) -> Iterator[I]:
        """Every item of a list endpoint, fetching each page when the one before it is used up."""
        call: calls.Call[P] | None = paging.first
        seen, keys = 0, set[Hashable]()
        while call is not None:
            page = self.send(call)
            items = paging.items(page)
            seen += len(items)
            yield from paging.unseen(items, keys)
            call = paging.after(page, seen)

    def ready(self) -> bool:
        """Whether the API answers /readyz with 200 (its database reachable; an unreachable broker only
        makes it "degraded": pages are still stored); never raises."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    # ------------------------------------------------------------------ ingestion (signed)

    def ingest_page(
        self, page: Mapping[str, Any] | BaseModel, *, idempotency_key: str | None = None
    ) -> models.PagesAccepted:
        """Store one page and queue its extraction (POST /v1/pages)."""
        return self.send(calls.ingest(page, idempotency_key))

    def ingest_pages(
        self, pages: Sequence[Mapping[str, Any] | BaseModel], *, idempotency_key: str | None = None
    ) -> models.PagesAccepted:
        """Store a batch of pages (at most 1,000) in one transaction and queue their extraction."""
        return self.send(calls.ingest_pages(pages, idempotency_key))

    def append_messages(
        self,
        transcript_id: str,
        messages: Iterable[Mapping[str, Any]],
        *,
        settings: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> models.AppendOut:
        """Append messages to a transcript (created on first use); queues a compaction when due."""
        return self.send(calls.append_messages(transcript_id, messages, settings, idempotency_key))

    # ------------------------------------------------------------------ jobs

    def get_job(self, job_id: int) -> models.JobOut:
        return self.send(calls.get_job(job_id))

    def list_jobs(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
    ) -> models.JobList:
        """One page of jobs, newest first."""
        return self.send(calls.list_jobs(status, kind, limit, before_id))

    def iter_jobs(
        self, *, status: str | None = None, kind: str | None = None, page_size: int = 200
    ) -> Iterator[models.JobOut]:
        """Every job (of ``status``/``kind``), newest first, page by page."""
        return self.iterate(calls.jobs_paging(status, kind, page_size))

    def retry_job(self, job_id: int, *, skipped: bool = False) -> models.JobOut:
        """Queue a failed, paused or succeeded job again (admin scope)."""
        return self.send(calls.retry_job(job_id, skipped))

    def wait_for_job(self, job_id: int, *, timeout: float = 300.0, interval: float = 0.3) -> models.JobOut:
        """The job once it has succeeded or failed; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job.done:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout:.0f} s")
            time.sleep(interval)

    # ------------------------------------------------------------------ facts, search, pages

    def list_pages(
        self,
        *,
        source_id: str | None = None,
        slug_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> models.PageList:
        """One page of the stored pages, by source and slug; ``after`` is the previous one's next_after."""
        return self.send(calls.list_pages(source_id, slug_prefix, limit, after))

    def iter_pages(
        self, *, source_id: str | None = None, slug_prefix: str | None = None, page_size: int = 500
    ) -> Iterator[models.PageSummary]:
        """Every stored page (of ``source_id``, under ``slug_prefix``), by source and slug."""
        return self.iterate(calls.pages_paging(source_id, slug_prefix, page_size))

    def page_facts(
        self,
        source_id: str,
        slug: str,
        *,
        limit: int = 1000,
        offset: int = 0,
        include_history: bool = False,
        as_of: datetime | None = None,
        after_row_num: int | None = None,
    ) -> models.PageFactsPage:
        """One page of a page's facts, in row order (``after_row_num``: the ``next_after_row_num`` of
        the page before)."""
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.send(calls.page_facts(source_id, slug, limit, offset, history, after_row_num))

    def iter_page_facts(
        self,
        source_id: str,
        slug: str,
        *,
        page_size: int = 1000,
        include_history: bool = False,
        as_of: datetime | None = None,
    ) -> Iterator[models.FactRecord]:
        """Every fact of a page, in row order, page by page."""
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.iterate(calls.facts_paging(source_id, slug, page_size, history))

    def entity_facts(
        self,
        entity: str,
        *,
        source_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
        include_history: bool = False,
        as_of: datetime | None = None,
        after: str | None = None,
    ) -> models.EntityFactsPage:
        """One page of an entity's facts (its slug, e.g. people/alice-example), newest first (``after``:
        the ``next_after`` of the page before)."""
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.send(calls.entity_facts(entity, source_id, limit, offset, history, after))

    def iter_entity_facts(
        self,
        entity: str,
        *,
        source_id: str | None = None,
        page_size: int = 500,
        include_history: bool = False,
        as_of: datetime | None = None,
    ) -> Iterator[models.EntityFact]:
        """Every fact about ``entity``, newest first, page by page."""
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.iterate(calls.entity_facts_paging(entity, source_id, page_size, history))

    def search(
        self,
        q: str,
        *,
        intent: str | None = None,
        source_id: str | None = None,
        entity: str | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        limit: int | None = None,
        expand: bool | None = None,
        include_history: bool | None = None,
        as_of: datetime | None = None,
    ) -> models.SearchOut:
        """Search the facts: a plain query, or a query document of lex:/vec:/hyde:/intent: lines."""
        filters: dict[str, Any] = {"intent": intent, "source_id": source_id, "entity": entity}
        filters |= {"kind": kind, "since": since, "limit": limit, "expand": expand}
        filters |= {"include_history": include_history, "as_of": as_of}
        return self.send(calls.search(q, filters))

    def delete_page(self, source_id: str, slug: str) -> models.PageErased:
        """Erase a page and everything drawn from it (admin scope)."""
        return self.send(calls.delete_page(source_id, slug))

    def delete_transcript(self, transcript_id: str) -> models.TranscriptErased:
        """Erase a transcript: its messages and compactions (admin scope)."""
        return self.send(calls.delete_transcript(transcript_id))

    # ------------------------------------------------------------------ backfills (admin)

    def start_backfill(
        self,
        source_id: str = "default",
        *,
        since: datetime | None = None,
        slug_prefix: str | None = None,
        max_segments: int | None = None,
    ) -> models.BackfillCreated:
        """Extract the selected pages' pending segments through provider batches (half price)."""
        selection = {"source_id": source_id, "since": since, "slug_prefix": slug_prefix}
        return self.send(calls.start_backfill(selection | {"max_segments": max_segments}))

    def get_backfill(self, backfill_id: int) -> models.BackfillReport:
        """A backfill's state: its batches, its requests by status, its LLM calls and cost so far."""
        return self.send(calls.get_backfill(backfill_id))

    def list_backfills(
        self, *, status: str | None = None, limit: int = 50, before_id: int | None = None
    ) -> models.BackfillList:
        """One page of backfills, newest first, each with its job's status."""
        return self.send(calls.list_backfills(status, limit, before_id))

    def cancel_backfill(self, backfill_id: int) -> models.BackfillReport:
        """Unsent batches never go; running ones are cancelled at the provider."""
        return self.send(calls.cancel_backfill(backfill_id))

    # ------------------------------------------------------------------ config (admin)

    def list_config(self) -> models.ConfigList:
        """Every key workers read, set or not, and any set key nothing reads (admin scope)."""
        return self.send(calls.list_config())

    def get_config(self, key: str) -> models.ConfigOut:
        return self.send(calls.get_config(key))

    def set_config(self, key: str, value: calls.ConfigValue) -> models.ConfigSetOut:
        """Set a kill switch or tunable; turning a kill switch on resumes its paused jobs."""
        return self.send(calls.set_config(key, value))

    def unset_config(self, key: str) -> models.ConfigSetOut:
        """Unset a key so it means its default again (a kill switch: on, resuming its paused jobs)."""
        return self.send(calls.unset_config(key))

    # ------------------------------------------------------------------ transcripts (reads)

    def list_transcripts(self, *, limit: int = 50) -> models.TranscriptList:
        """Transcripts, most recently changed first, with their message and token counts."""
        return self.send(calls.list_transcripts(limit))

    def get_transcript(self, transcript_id: str) -> models.TranscriptOut:
        return self.send(calls.get_transcript(transcript_id))

    def get_context(self, transcript_id: str) -> models.ContextOut:
        """What to send a model now: the newest accepted summary plus the messages after its cut."""
        return self.send(calls.get_context(transcript_id))

    def list_messages(
        self, transcript_id: str, *, after_seq: int | None = None, limit: int = 1000
    ) -> models.MessagesOut:
        return self.send(calls.list_messages(transcript_id, after_seq, limit))

    def iter_messages(
        self, transcript_id: str, *, page_size: int = 1000
    ) -> Iterator[models.StoredMessageOut]:
        """The transcript's full history in order, page by page."""
        return self.iterate(calls.messages_paging(transcript_id, page_size))

    def set_transcript_settings(
        self, transcript_id: str, settings: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> models.TranscriptOut:
        """Create a transcript or change its settings (signed): only the settings sent change."""
        return self.send(calls.set_transcript_settings(transcript_id, settings, idempotency_key))

    def list_compactions(
        self, transcript_id: str, *, limit: int = 50, before_id: int | None = None
    ) -> models.CompactionsOut:
        """Its compactions, newest first: an ``id`` and its ``coverage`` are what record_feedback takes."""
        return self.send(calls.list_compactions(transcript_id, limit, before_id))

    # ------------------------------------------------------------------ calibration

    def record_feedback(
        self,
        coverage: float,
        answer_kept: bool,
        *,
        origin: str,
        compaction_id: int | None = None,
        idempotency_key: str | None = None,
    ) -> models.FeedbackOut:
        """Label a compaction for calibration (signed): whether the answer survived its summary, with the
        coverage it scored. Stored once per key: a repeat answers ``duplicate`` true."""
        return self.send(calls.record_feedback(coverage, answer_kept, origin, compaction_id, idempotency_key))

    def get_calibration(self, *, limit: int = 50) -> models.CalibrationOut:
        """The threshold the quality gate uses now, the observations, and ``limit`` versions of history."""
        return self.send(calls.get_calibration(limit))


__all__ = ["Client"]
