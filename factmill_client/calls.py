"""What each API call sends and what it answers, shared by the sync and the async client.

A ``Call`` is one logical request: its method, path, query, body, the model of its answer, whether it
is signed, and its Idempotency-Key (made once here, so every retry of the call carries the same one).
The clients only send calls; the rules of each endpoint live here once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import BaseModel

from factmill_client import models
from factmill_client.signing import signable_key

T = TypeVar("T", bound=BaseModel)
P = TypeVar("P", bound=BaseModel)
I = TypeVar("I")  # noqa: E741  (the item type of a paged list)


def new_idempotency_key() -> str:
    return f"fm-{uuid.uuid4().hex}"


def delivery_key(key: str | None) -> str:
    """The Idempotency-Key of an ingestion call: the caller's, checked (a v4 signature binds it, so it
    must read alike on both sides: printable ASCII), else a new one."""
    if key is None:
        return new_idempotency_key()
    if not signable_key(key):
        raise ValueError(
            f"idempotency_key {key!r} must be 1 to 255 printable ASCII characters, without surrounding spaces"
        )
    return key


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str  # percent-encoded, as sent (and as a signature binds it)
    model: type[T]
    params: Mapping[str, Any] | None = None
    body: bytes | None = None
    signed: bool = False  # signed with the webhook secret when the client has one
    # Sent on every POST; the server replays the stored answer for a repeat of an ingestion call.
    idempotency_key: str | None = None
    # Whether sending the call again after an unknown outcome (a timeout, a 5xx) is harmless: true for
    # reads, PUTs and the deduplicated ingestion POSTs; false where a repeat would act twice.
    replayable: bool = True


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_body(payload: Any) -> bytes:
    """The exact bytes sent (and signed): UTF-8 JSON, non-ASCII kept, NaN refused as the server would."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, default=_json_default).encode("utf-8")


def segment(value: str | int) -> str:
    """One path segment, percent-encoded ('/' included). A segment that is all dots (a transcript may
    be named "..") is escaped too: httpx, like any URL library, would resolve "." and ".." away and
    send the call to another route."""
    text = str(value)
    if text in (".", ".."):
        return text.replace(".", "%2E")
    return quote(text, safe="")


def transcript_segment(transcript_id: str) -> str:
    """A transcript id as a path segment. The server decodes %2F before it routes, so an id holding '/'
    reached another route ("alice%2Fmessages" read alice's messages) or none (a bare 404 for an append,
    which creates its transcript): refused here, as the server's rule does (no whitespace, no '/')."""
    if "/" in transcript_id:
        raise ValueError(f"transcript id {transcript_id!r}: a transcript id holds no '/'")
    return segment(transcript_id)


def slash_path(value: str) -> str:
    """A name that holds '/' (a slug: conversations/2024/alice), which the route takes as a path: each
    part encoded as ``segment`` does, so a "." or ".." part is not resolved away either
    ("people/../alice" went to alice's facts)."""
    return "/".join(segment(part) for part in value.split("/"))


def page_path(source_id: str, slug: str) -> str:
    return f"/v1/pages/{segment(source_id)}/{slash_path(slug)}"


def _query(**values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, datetime):
            out[name] = value.isoformat()
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------- writes


def ingest(payload: Any, idempotency_key: str | None) -> Call[models.PagesAccepted]:
    return Call(
        "POST",
        "/v1/pages",
        models.PagesAccepted,
        body=json_body(payload),
        signed=True,
        idempotency_key=delivery_key(idempotency_key),
    )


def ingest_pages(pages: Sequence[Any], idempotency_key: str | None) -> Call[models.PagesAccepted]:
    return ingest({"pages": list(pages)}, idempotency_key)


def append_messages(
    transcript_id: str,
    messages: Iterable[Mapping[str, Any]],
    settings: Mapping[str, Any] | None,
    idempotency_key: str | None,
) -> Call[models.AppendOut]:
    payload: dict[str, Any] = {"messages": list(messages)}
    if settings is not None:
        payload["settings"] = dict(settings)
    return Call(
        "POST",
        f"/v1/transcripts/{transcript_segment(transcript_id)}/messages",
        models.AppendOut,
        body=json_body(payload),
        signed=True,
        idempotency_key=delivery_key(idempotency_key),
    )


def set_transcript_settings(
    transcript_id: str, settings: Mapping[str, Any], idempotency_key: str | None
) -> Call[models.TranscriptOut]:
    # Signed, and a repeat with its key is answered as the first (nothing changes twice).
    return Call(
        "PUT",
        f"/v1/transcripts/{transcript_segment(transcript_id)}",
        models.TranscriptOut,
        body=json_body(dict(settings)),
        signed=True,
        idempotency_key=delivery_key(idempotency_key),
    )


def record_feedback(
    coverage: float,
    answer_kept: bool,
    origin: str,
    compaction_id: int | None,
    idempotency_key: str | None,
) -> Call[models.FeedbackOut]:
    # Signed; stored once per key (a repeat answers 200 with duplicate true), so it may be sent again.
    payload: dict[str, Any] = {"coverage": coverage, "answer_kept": answer_kept, "origin": origin}
    if compaction_id is not None:
        payload["compaction_id"] = compaction_id
    return Call(
        "POST",
        "/v1/feedback",
        models.FeedbackOut,
        body=json_body(payload),
        signed=True,
        idempotency_key=delivery_key(idempotency_key),
    )


def retry_job(job_id: int, skipped: bool) -> Call[models.JobOut]:
    # Not deduplicated by the server: a repeat of a retry that did go through is answered 409 (the job
    # is already queued), so only a request that surely never arrived is sent again.
    return Call(
        "POST",
        f"/v1/jobs/{int(job_id)}/retry",
        models.JobOut,
        params=_query(skipped=skipped or None),
        idempotency_key=new_idempotency_key(),
        replayable=False,
    )


def start_backfill(selection: Mapping[str, Any]) -> Call[models.BackfillCreated]:
    # Not deduplicated by the server: a repeat after an unknown outcome could start a second backfill.
    body = json_body({name: value for name, value in selection.items() if value is not None})
    key = new_idempotency_key()
    return Call(
        "POST", "/v1/backfills", models.BackfillCreated, body=body, idempotency_key=key, replayable=False
    )


def get_backfill(backfill_id: int) -> Call[models.BackfillReport]:
    return Call("GET", f"/v1/backfills/{int(backfill_id)}", models.BackfillReport)


def list_backfills(status: str | None, limit: int, before_id: int | None) -> Call[models.BackfillList]:
    return Call(
        "GET",
        "/v1/backfills",
        models.BackfillList,
        params=_query(status=status, limit=limit, before_id=before_id),
    )


def cancel_backfill(backfill_id: int) -> Call[models.BackfillReport]:
    # Cancelling twice answers the same state: safe to resend.
    path = f"/v1/backfills/{int(backfill_id)}/cancel"
    return Call("POST", path, models.BackfillReport, idempotency_key=new_idempotency_key())


# A config value: text, a number, true/false, or a JSON object (llm.prices), stored as its text.
ConfigValue = str | bool | int | float | dict[str, Any]


def set_config(key: str, value: ConfigValue) -> Call[models.ConfigSetOut]:
    return Call("PUT", f"/v1/config/{segment(key)}", models.ConfigSetOut, body=json_body({"value": value}))


def unset_config(key: str) -> Call[models.ConfigSetOut]:
    # Unsetting a key twice leaves it unset: safe to resend. (A resend for a row of a key nothing reads,
    # which the first one removed, answers 404: such keys are only ever removed, once.)
    return Call("DELETE", f"/v1/config/{segment(key)}", models.ConfigSetOut)


def delete_page(source_id: str, slug: str) -> Call[models.PageErased]:
    # A repeat of an erasure that went through answers 404: like retry_job, only resent when unsent.
    return Call("DELETE", page_path(source_id, slug), models.PageErased, replayable=False)


def delete_transcript(transcript_id: str) -> Call[models.TranscriptErased]:
    return Call(
        "DELETE",
        f"/v1/transcripts/{transcript_segment(transcript_id)}",
        models.TranscriptErased,
        replayable=False,
    )


# ---------------------------------------------------------------------------- reads


def get_job(job_id: int) -> Call[models.JobOut]:
    return Call("GET", f"/v1/jobs/{int(job_id)}", models.JobOut)


def list_jobs(
    status: str | None, kind: str | None, limit: int, before_id: int | None
) -> Call[models.JobList]:
    params = _query(status=status, kind=kind, limit=limit, before_id=before_id)
    return Call("GET", "/v1/jobs", models.JobList, params=params)


def list_pages(
    source_id: str | None, slug_prefix: str | None, limit: int, after: str | None
) -> Call[models.PageList]:
    params = _query(source_id=source_id, slug_prefix=slug_prefix, limit=limit, after=after)
    return Call("GET", "/v1/pages", models.PageList, params=params)


def pages_paging(
    source_id: str | None, slug_prefix: str | None, page_size: int
) -> Paging[models.PageList, models.PageSummary]:
    """By source and slug, after the last page seen, so pages stored meanwhile never shift a page."""

    def after(page: models.PageList, _seen: int) -> Call[models.PageList] | None:
        return list_pages(source_id, slug_prefix, page_size, page.next_after) if page.next_after else None

    return Paging(list_pages(source_id, slug_prefix, page_size, None), lambda page: page.pages, after)


def page_facts(
    source_id: str,
    slug: str,
    limit: int,
    offset: int,
    history: Mapping[str, Any] | None = None,
    after_row_num: int | None = None,
) -> Call[models.PageFactsPage]:
    """``history``: include_history / as_of (current facts only by default)."""
    path = page_path(source_id, slug) + "/facts"
    params = _query(limit=limit, offset=offset, after_row_num=after_row_num, **(history or {}))
    return Call("GET", path, models.PageFactsPage, params=params)


def entity_facts(
    entity: str,
    source_id: str | None,
    limit: int,
    offset: int,
    history: Mapping[str, Any] | None = None,
    after: str | None = None,
) -> Call[models.EntityFactsPage]:
    """``history``: include_history / as_of (current facts only by default)."""
    path = f"/v1/entities/{slash_path(entity)}/facts"  # a slug holds '/' (people/alice)
    params = _query(source_id=source_id, limit=limit, offset=offset, after=after, **(history or {}))
    return Call("GET", path, models.EntityFactsPage, params=params)


def search(q: str, filters: Mapping[str, Any]) -> Call[models.SearchOut]:
    # POST, not GET: a query document spans lines; the body is a read, so resending it is harmless.
    body = {"q": q, **{k: v for k, v in filters.items() if v is not None}}
    return Call(
        "POST", "/v1/search", models.SearchOut, body=json_body(body), idempotency_key=new_idempotency_key()
    )


def list_config() -> Call[models.ConfigList]:
    return Call("GET", "/v1/config", models.ConfigList)


def get_config(key: str) -> Call[models.ConfigOut]:
    return Call("GET", f"/v1/config/{segment(key)}", models.ConfigOut)


def get_transcript(transcript_id: str) -> Call[models.TranscriptOut]:
    return Call("GET", f"/v1/transcripts/{transcript_segment(transcript_id)}", models.TranscriptOut)


def list_transcripts(limit: int) -> Call[models.TranscriptList]:
    return Call("GET", "/v1/transcripts", models.TranscriptList, params=_query(limit=limit))


def get_context(transcript_id: str) -> Call[models.ContextOut]:
    return Call("GET", f"/v1/transcripts/{transcript_segment(transcript_id)}/context", models.ContextOut)


def list_compactions(transcript_id: str, limit: int, before_id: int | None) -> Call[models.CompactionsOut]:
    path = f"/v1/transcripts/{transcript_segment(transcript_id)}/compactions"
    return Call("GET", path, models.CompactionsOut, params=_query(limit=limit, before_id=before_id))


def get_calibration(limit: int) -> Call[models.CalibrationOut]:
    return Call("GET", "/v1/calibration", models.CalibrationOut, params=_query(limit=limit))


def list_messages(transcript_id: str, after_seq: int | None, limit: int) -> Call[models.MessagesOut]:
    path = f"/v1/transcripts/{transcript_segment(transcript_id)}/messages"
    return Call("GET", path, models.MessagesOut, params=_query(after_seq=after_seq, limit=limit))


# ---------------------------------------------------------------------------- paging


@dataclass(frozen=True)
class Paging(Generic[P, I]):
    """How to walk a list endpoint: the first call, the items of a page, and the call for the page after
    it given the items read so far (None at the end)."""

    first: Call[P]
    items: Callable[[P], Sequence[I]]
    after: Callable[[P, int], Call[P] | None] = field(repr=False)
    # Where an item read already may come again on a later page (its place moved past the cursor
    # meanwhile): what names it, so a walk yields it once.
    key: Callable[[I], Hashable] | None = field(default=None, repr=False)

    def unseen(self, items: Sequence[I], keys: set[Hashable]) -> list[I]:
        """``items`` less those a walk yielded already (``keys``, which it updates)."""
        if self.key is None:
            return list(items)
        fresh = []
        for item in items:
            name = self.key(item)
            if name not in keys:
                keys.add(name)
                fresh.append(item)
        return fresh


def jobs_paging(
    status: str | None, kind: str | None, page_size: int
) -> Paging[models.JobList, models.JobOut]:
    """Newest first, by id: ``before_id`` the last id seen, so jobs created meanwhile never shift a page."""

    def after(page: models.JobList, _seen: int) -> Call[models.JobList] | None:
        if len(page.jobs) < page_size:
            return None
        return list_jobs(status, kind, page_size, page.jobs[-1].id)

    return Paging(list_jobs(status, kind, page_size, None), lambda page: page.jobs, after)


def facts_paging(
    source_id: str, slug: str, page_size: int, history: Mapping[str, Any] | None = None
) -> Paging[models.PageFactsPage, models.FactRecord]:
    """Row order, by the ``next_after_row_num`` cursor (offset paging read a fact twice, or skipped one,
    when the page's facts changed between two reads); by offset from a server that answers none."""

    def after(page: models.PageFactsPage, seen: int) -> Call[models.PageFactsPage] | None:
        if page.next_after_row_num is not None:
            return page_facts(source_id, slug, page_size, 0, history, page.next_after_row_num)
        if not page.facts or seen >= page.total or "next_after_row_num" in page.model_fields_set:
            return None
        return page_facts(source_id, slug, page_size, seen, history)

    return Paging(page_facts(source_id, slug, page_size, 0, history), lambda page: page.facts, after)


def entity_facts_paging(
    entity: str, source_id: str | None, page_size: int, history: Mapping[str, Any] | None = None
) -> Paging[models.EntityFactsPage, models.EntityFact]:
    """Newest first, by the ``next_after`` cursor (by offset, facts stored or superseded meanwhile were
    read twice or skipped); by offset from a server that answers none."""

    def after(page: models.EntityFactsPage, seen: int) -> Call[models.EntityFactsPage] | None:
        if page.next_after is not None:
            return entity_facts(entity, source_id, page_size, 0, history, page.next_after)
        if not page.facts or seen >= page.total or "next_after" in page.model_fields_set:
            return None
        return entity_facts(entity, source_id, page_size, seen, history)

    first = entity_facts(entity, source_id, page_size, 0, history)
    # A consolidation that moves a fact's start earlier while the walk goes on puts it past the cursor
    # again (the route says: de-duplicate by id).
    return Paging(first, lambda page: page.facts, after, key=lambda fact: fact.id)


def messages_paging(
    transcript_id: str, page_size: int
) -> Paging[models.MessagesOut, models.StoredMessageOut]:
    """Seq order, by the ``next_after_seq`` cursor the server answers (None on the last page)."""

    def after(page: models.MessagesOut, _seen: int) -> Call[models.MessagesOut] | None:
        if page.next_after_seq is None:
            return None
        return list_messages(transcript_id, page.next_after_seq, page_size)

    return Paging(list_messages(transcript_id, None, page_size), lambda page: page.messages, after)
