"""The asynchronous client: ``AsyncClient``, the same calls as ``Client`` for asyncio code.

It sends the calls of factmill_client.calls with the one retry policy of factmill_client.transport;
only the waiting differs from the sync client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from factmill_client import calls, models
from factmill_client.client import USER_AGENT
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


class AsyncClient:
    """The Factmill HTTP API for async code; see ``Client`` for the arguments."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        webhook_secret: Secrets | None = None,
        timeout: float | httpx.Timeout | None = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        redate_after_seconds: float = REDATE_AFTER_SECONDS,
    ) -> None:
        # Checked before the connection pool is made: a refused argument leaves nothing open.
        self._credentials = Credentials(api_key, webhook_secret, clock, redate_after_seconds)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=http_timeout(timeout),
            transport=transport,
            headers={"User-Agent": USER_AGENT},
        )
        self._end_routes_only = routes_only_in_httpx_logs(self._http.base_url)
        self.retry = retry or RetryPolicy()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        self._end_routes_only()

    async def send(self, call: calls.Call[T]) -> T:
        """Send ``call`` (retrying as ``self.retry`` says) and answer its model."""
        attempt = 0
        signed_at: int | None = None
        while True:
            attempt += 1
            signed_at = self._credentials.signing_time(signed_at)
            request = build_request(self._http, call, self._credentials, signed_at)
            try:
                response = await self._http.send(request)
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
            await asyncio.sleep(pause)

    async def iterate(self, paging: calls.Paging[P, I]) -> AsyncIterator[I]:
        """Every item of a list endpoint, fetching each page when the one before it is used up."""
        call: calls.Call[P] | None = paging.first
        seen, keys = 0, set[Hashable]()
        while call is not None:
            page = await self.send(call)
            items = paging.items(page)
            seen += len(items)
            for item in paging.unseen(items, keys):
                yield item
            call = paging.after(page, seen)

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def ingest_page(
        self, page: Mapping[str, Any] | BaseModel, *, idempotency_key: str | None = None
    ) -> models.PagesAccepted:
        return await self.send(calls.ingest(page, idempotency_key))

    async def ingest_pages(
        self, pages: Sequence[Mapping[str, Any] | BaseModel], *, idempotency_key: str | None = None
    ) -> models.PagesAccepted:
        return await self.send(calls.ingest_pages(pages, idempotency_key))

    async def append_messages(
        self,
        transcript_id: str,
        messages: Iterable[Mapping[str, Any]],
        *,
        settings: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> models.AppendOut:
        return await self.send(calls.append_messages(transcript_id, messages, settings, idempotency_key))

    async def get_job(self, job_id: int) -> models.JobOut:
        return await self.send(calls.get_job(job_id))

    async def list_jobs(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
    ) -> models.JobList:
        return await self.send(calls.list_jobs(status, kind, limit, before_id))

    def iter_jobs(
        self, *, status: str | None = None, kind: str | None = None, page_size: int = 200
    ) -> AsyncIterator[models.JobOut]:
        return self.iterate(calls.jobs_paging(status, kind, page_size))

    async def retry_job(self, job_id: int, *, skipped: bool = False) -> models.JobOut:
        return await self.send(calls.retry_job(job_id, skipped))

    async def wait_for_job(
        self, job_id: int, *, timeout: float = 300.0, interval: float = 0.3
    ) -> models.JobOut:
        deadline = time.monotonic() + timeout
        while True:
            job = await self.get_job(job_id)
            if job.done:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout:.0f} s")
            await asyncio.sleep(interval)

    async def list_pages(
        self,
        *,
        source_id: str | None = None,
        slug_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> models.PageList:
        return await self.send(calls.list_pages(source_id, slug_prefix, limit, after))

    def iter_pages(
        self, *, source_id: str | None = None, slug_prefix: str | None = None, page_size: int = 500
    ) -> AsyncIterator[models.PageSummary]:
        return self.iterate(calls.pages_paging(source_id, slug_prefix, page_size))

    async def page_facts(
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
        history = {"include_history": include_history or None, "as_of": as_of}
        return await self.send(calls.page_facts(source_id, slug, limit, offset, history, after_row_num))

    def iter_page_facts(
        self,
        source_id: str,
        slug: str,
        *,
        page_size: int = 1000,
        include_history: bool = False,
        as_of: datetime | None = None,
    ) -> AsyncIterator[models.FactRecord]:
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.iterate(calls.facts_paging(source_id, slug, page_size, history))

    async def entity_facts(
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
        history = {"include_history": include_history or None, "as_of": as_of}
        return await self.send(calls.entity_facts(entity, source_id, limit, offset, history, after))

    def iter_entity_facts(
        self,
        entity: str,
        *,
        source_id: str | None = None,
        page_size: int = 500,
        include_history: bool = False,
        as_of: datetime | None = None,
    ) -> AsyncIterator[models.EntityFact]:
        history = {"include_history": include_history or None, "as_of": as_of}
        return self.iterate(calls.entity_facts_paging(entity, source_id, page_size, history))

    async def search(
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
        filters: dict[str, Any] = {"intent": intent, "source_id": source_id, "entity": entity}
        filters |= {"kind": kind, "since": since, "limit": limit, "expand": expand}
        filters |= {"include_history": include_history, "as_of": as_of}
        return await self.send(calls.search(q, filters))

    async def delete_page(self, source_id: str, slug: str) -> models.PageErased:
        return await self.send(calls.delete_page(source_id, slug))

    async def delete_transcript(self, transcript_id: str) -> models.TranscriptErased:
        return await self.send(calls.delete_transcript(transcript_id))

    async def start_backfill(
        self,
        source_id: str = "default",
        *,
        since: datetime | None = None,
        slug_prefix: str | None = None,
        max_segments: int | None = None,
    ) -> models.BackfillCreated:
        selection = {"source_id": source_id, "since": since, "slug_prefix": slug_prefix}
        return await self.send(calls.start_backfill(selection | {"max_segments": max_segments}))

    async def get_backfill(self, backfill_id: int) -> models.BackfillReport:
        return await self.send(calls.get_backfill(backfill_id))

    async def list_backfills(
        self, *, status: str | None = None, limit: int = 50, before_id: int | None = None
    ) -> models.BackfillList:
        return await self.send(calls.list_backfills(status, limit, before_id))

    async def cancel_backfill(self, backfill_id: int) -> models.BackfillReport:
        return await self.send(calls.cancel_backfill(backfill_id))

    async def list_config(self) -> models.ConfigList:
        return await self.send(calls.list_config())

    async def get_config(self, key: str) -> models.ConfigOut:
        return await self.send(calls.get_config(key))

    async def set_config(self, key: str, value: calls.ConfigValue) -> models.ConfigSetOut:
        return await self.send(calls.set_config(key, value))

    async def unset_config(self, key: str) -> models.ConfigSetOut:
        return await self.send(calls.unset_config(key))

    async def list_transcripts(self, *, limit: int = 50) -> models.TranscriptList:
        return await self.send(calls.list_transcripts(limit))

    async def get_transcript(self, transcript_id: str) -> models.TranscriptOut:
        return await self.send(calls.get_transcript(transcript_id))

    async def get_context(self, transcript_id: str) -> models.ContextOut:
        return await self.send(calls.get_context(transcript_id))

    async def list_messages(
        self, transcript_id: str, *, after_seq: int | None = None, limit: int = 1000
    ) -> models.MessagesOut:
        return await self.send(calls.list_messages(transcript_id, after_seq, limit))

    def iter_messages(
        self, transcript_id: str, *, page_size: int = 1000
    ) -> AsyncIterator[models.StoredMessageOut]:
        return self.iterate(calls.messages_paging(transcript_id, page_size))

    async def set_transcript_settings(
        self, transcript_id: str, settings: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> models.TranscriptOut:
        """Create a transcript or change its settings (signed): only the settings sent change."""
        return await self.send(calls.set_transcript_settings(transcript_id, settings, idempotency_key))

    async def list_compactions(
        self, transcript_id: str, *, limit: int = 50, before_id: int | None = None
    ) -> models.CompactionsOut:
        """Its compactions, newest first: an ``id`` and its ``coverage`` are what record_feedback takes."""
        return await self.send(calls.list_compactions(transcript_id, limit, before_id))

    # ------------------------------------------------------------------ calibration

    async def record_feedback(
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
        return await self.send(
            calls.record_feedback(coverage, answer_kept, origin, compaction_id, idempotency_key)
        )

    async def get_calibration(self, *, limit: int = 50) -> models.CalibrationOut:
        """The threshold the quality gate uses now, the observations, and ``limit`` versions of history."""
        return await self.send(calls.get_calibration(limit))


__all__ = ["AsyncClient"]
