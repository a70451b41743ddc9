"""The MCP tools: each one a thin call into the service the matching API route uses, with its access rule.

The access rules (scope, and whether the data is partitioned by source) are the API's: a tool a
principal may not use is neither listed nor callable (``worker.mcp.server`` enforces both).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field, Strict, StrictBool
from sqlalchemy.orm import Session

from models.reads import one_snapshot, read_only
from worker.access import Principal, readable_sources
from worker.access.ratelimit import InFlightPerKey, PerKeyLimiter
from worker.calibration import MAX_KEY_LENGTH, MAX_ORIGIN_LENGTH, ObservationIn, add_observation
from worker.compaction import (
    MAX_MESSAGES_PER_REQUEST,
    append_messages,
    context_view,
    list_messages,
    parse_messages,
)
from worker.compaction.erase import refuse_if_erased_since
from worker.compaction.views import measured_coverage
from worker.consolidation.history import Lifecycle
from worker.core.compaction import TranscriptMessage
from worker.core.jsonvalues import BIGINT_MAX
from worker.core.labels import clean_label
from worker.core.signing import MAX_IDEMPOTENCY_KEY_LENGTH
from worker.core.transcripts import MAX_TRANSCRIPT_ID_LENGTH, TranscriptError
from worker.deliveries import deliver_once, replayed_answer, scoped_key
from worker.extraction.catalog import (
    MAX_LISTED_PAGES,
    MAX_PAGE_CURSOR_LENGTH,
    PageList,
    list_pages,
    page_cursor,
)
from worker.extraction.facts import (
    EntityFactsPage,
    PageFactsPage,
    read_entity_facts,
    read_page_facts,
)
from worker.extraction.pages import MAX_SLUG_INPUT_LENGTH
from worker.jobs import sending
from worker.mcp.arrival import arrived_at
from worker.mcp.inputs import (
    JSON_INTEGER,
    MCP_APPEND,
    MCP_CONTEXT_MAX_BYTES,
    READS,
    READS_AND_CALLS_MODEL,
    SCORED_COVERAGE,
    WRITES,
    Access,
    AsOf,
    EntityCursor,
    EntityName,
    IncludeHistory,
    KindName,
    MessageIn,
    Offset,
    PageSlug,
    SeqCursor,
    SourceId,
    SourceIdFilter,
    Text,
    ToolCallIn,
    checked_transcript_id,
    refusals,
    within_body_cap,
)
from worker.runtime import Runtime
from worker.search import MAX_INTENT_CHARS, MAX_LIMIT, MAX_QUERY_CHARS, search_as

logger = logging.getLogger(__name__)


def _append(
    transcript_id: str,
    parsed: list[TranscriptMessage],
    settings: dict[str, Any] | None,
    retrigger: float,
    session: Session,
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """An MCP append in its delivery's transaction: the answer, and the jobs to send after the commit.
    Dated when the call arrived (``arrived_at``); an erasure that commits while the write waits on the
    transcript's row is later, and refuses it."""
    arrived = arrived_at(session)
    refuse_if_erased_since(session, transcript_id, arrived)  # before (why), after (waited on it)
    result = append_messages(session, transcript_id, parsed, settings=settings, retrigger_seconds=retrigger)
    refuse_if_erased_since(session, transcript_id, arrived)
    trigger = result.trigger
    answer = {
        "transcript_id": transcript_id,
        "appended": len(parsed),
        "first_seq": result.first_seq,
        "last_seq": result.last_seq,
        "context_tokens": trigger.context_tokens,
        "trigger_tokens": trigger.trigger_tokens,
        "compaction_job_id": trigger.job.job_id if trigger.job is not None else None,
        "note": trigger.note,
    }
    return answer, result.pending_jobs()


class FactmillTools:
    """The tools over one runtime; ``principal()`` names the caller of the current request."""

    def __init__(
        self, runtime: Runtime, principal: Callable[[], Principal], limiter: PerKeyLimiter | None = None
    ) -> None:
        self.runtime = runtime
        self.principal = principal
        self.limiter = limiter or PerKeyLimiter.for_runtime(runtime)
        # As the API's: a key's searches running at once in this process (each holds a thread of the
        # server's pool, maybe for a minute on the LLM).
        self.running = InFlightPerKey(runtime.settings.search_concurrency_per_key)

    def search_facts(
        self,
        query: Annotated[
            Text,
            Field(
                min_length=1,
                max_length=MAX_QUERY_CHARS,
                description=(
                    "Plain words (e.g. 'where does Alice live'), or a query document: one search per "
                    "line, each 'lex: words' (keyword search, no LLM), 'vec: words' or 'hyde: a "
                    "hypothetical answer' (semantic), and optionally 'intent: what you are after'."
                ),
            ),
        ],
        intent: Annotated[
            Text | None,
            Field(
                max_length=MAX_INTENT_CHARS,
                description="What you want the facts for; sharpens ranking and snippets.",
            ),
        ] = None,
        source_id: Annotated[SourceIdFilter | None, Field(description="Only facts from this source.")] = None,
        entity: Annotated[
            EntityName | None, Field(description="Only facts about this entity slug (e.g. 'alice').")
        ] = None,
        kind: Annotated[KindName | None, Field(description="Only facts of this kind.")] = None,
        since: Annotated[
            datetime | None, Field(description="Only facts valid (or written) since this ISO 8601 time.")
        ] = None,
        limit: Annotated[
            Annotated[int, Strict(), Field(ge=1, le=MAX_LIMIT), JSON_INTEGER] | None,
            Field(description="At most this many."),
        ] = None,
        expand: Annotated[
            StrictBool, Field(description="Let an LLM add related searches to a plain query.")
        ] = True,
        as_of: AsOf = None,
        include_history: IncludeHistory = False,
    ) -> dict[str, Any]:
        """Search the stored facts and get the best matches, each with its text, kind, entity, page,
        confidence, status (current, superseded, duplicate), validity interval and a snippet (only
        current ones unless as_of or include_history). Plain words and vec:/hyde: lines call the model
        (paid); lex: lines do not. Start here to answer a question about people, plans or events."""
        principal = self.principal()
        with self.running.held(principal.rate_key, self._too_many_running):
            verdict = self.limiter.hit(principal.rate_key)
            if not verdict.allowed:
                raise ToolError(
                    f"too many searches for this key: at most {self.limiter.per_minute} a minute; "
                    f"retry in {verdict.retry_after} s"
                )
            with refusals():
                outcome = search_as(
                    self.runtime,
                    principal,
                    query,
                    intent=intent,
                    source_id=source_id,
                    entity=entity,
                    kind=kind,
                    since=since,
                    limit=limit,
                    expand=expand,
                    include_history=include_history,
                    as_of=as_of,
                )
        return outcome.as_dict()

    def _too_many_running(self) -> ToolError:
        return ToolError(
            f"this key has {self.running.most} searches running; send the next one when one has answered"
        )

    def list_entity_facts(
        self,
        entity: Annotated[EntityName, Field(description="The entity slug, e.g. 'alice'.")],
        source_id: Annotated[SourceIdFilter | None, Field(description="Only facts from this source.")] = None,
        limit: Annotated[
            int, Strict(), Field(ge=1, le=1000), JSON_INTEGER, Field(description="At most this many facts.")
        ] = 100,
        offset: Offset = 0,
        include_history: IncludeHistory = False,
        as_of: AsOf = None,
        after: EntityCursor = None,
    ) -> EntityFactsPage:
        """The current facts about one entity (a person, team or thing, by its slug), newest first,
        with the page each came from; with include_history, its whole timeline (each fact's status,
        interval and links). Use it to see all that is known about someone."""
        with refusals():
            sources = readable_sources(self.principal(), source_id)
        with one_snapshot(self.runtime.factory) as session, refusals():
            return read_entity_facts(
                session,
                entity,
                source_ids=sources,
                limit=limit,
                offset=offset,
                lifecycle=Lifecycle(include_history, as_of),
                after=after,
            )

    def list_pages(
        self,
        source_id: Annotated[SourceIdFilter | None, Field(description="Only pages of this source.")] = None,
        slug_prefix: Annotated[
            Text | None,
            Field(max_length=MAX_SLUG_INPUT_LENGTH, description="Only pages whose slug starts with this."),
        ] = None,
        limit: Annotated[
            int,
            Strict(),
            Field(ge=1, le=MAX_LISTED_PAGES),
            JSON_INTEGER,
            Field(description="At most this many."),
        ] = 100,
        after: Annotated[
            Text | None,
            Field(
                max_length=MAX_PAGE_CURSOR_LENGTH, description="next_after of the previous answer, to go on."
            ),
        ] = None,
    ) -> PageList:
        """The stored pages (conversations) by source and slug, each with its current facts and its last
        extraction job. Use it to find a page's slug for list_page_facts."""
        with refusals():
            sources = readable_sources(self.principal(), source_id)
        try:
            cursor = page_cursor(after)
        except ValueError as exc:
            raise ToolError(str(exc)) from None
        with read_only(self.runtime.factory) as session:
            return list_pages(session, source_ids=sources, slug_prefix=slug_prefix, limit=limit, after=cursor)

    def list_page_facts(
        self,
        slug: Annotated[PageSlug, Field(description="The page's slug, e.g. 'conversations/alice'.")],
        source_id: Annotated[SourceId, Field(description="The page's source.")] = "default",
        # At most 1,000 (the API's 10,000 facts are tens of MB, sent twice by the SDK: no agent's context
        # holds that); offset pages on, as for an entity's facts.
        limit: Annotated[
            int, Strict(), Field(ge=1, le=1000), JSON_INTEGER, Field(description="At most this many facts.")
        ] = 200,
        offset: Offset = 0,
        include_history: IncludeHistory = False,
        as_of: AsOf = None,
        after_row_num: Annotated[
            SeqCursor, Field(description="next_after_row_num of the previous answer, to go on.")
        ] = None,
    ) -> PageFactsPage:
        """The facts extracted from one page (a stored conversation), in the order they were found:
        the current ones, or with include_history / as_of its timeline or what was true then."""
        if not self.principal().sees(source_id):
            raise ToolError(f"this key may not read source {source_id!r}")
        with one_snapshot(self.runtime.factory) as session, refusals():
            found = read_page_facts(
                session,
                source_id,
                slug,
                limit=limit,
                offset=offset,
                lifecycle=Lifecycle(include_history, as_of),
                after_row_num=after_row_num,
            )
        if found is None:
            raise ToolError(f"no page {slug!r} in source {source_id!r}")
        return found

    def get_transcript_context(
        self,
        transcript_id: Annotated[
            Text, Field(min_length=1, max_length=MAX_TRANSCRIPT_ID_LENGTH, description="The transcript's id.")
        ],
    ) -> dict[str, Any]:
        """What to send a model now for an agent transcript: the newest accepted summary, then every
        message after it, repaired so each tool call has its result."""
        transcript_id = checked_transcript_id(transcript_id)
        with refusals(), one_snapshot(self.runtime.factory) as session:  # its statements agree
            view = context_view(session, transcript_id, max_bytes=MCP_CONTEXT_MAX_BYTES)
            scored = measured_coverage(session, view.compaction_id)
        return {
            "transcript_id": transcript_id,
            "compaction_id": view.compaction_id,
            # What a label of it (record_summary_feedback) carries: the coverage the gate measured.
            "coverage": scored,
            "cut_seq": view.cut_seq,
            "tokens": view.tokens,
            "messages": [m.as_dict() for m in view.messages],
        }

    def list_transcript_messages(
        self,
        transcript_id: Annotated[
            Text, Field(min_length=1, max_length=MAX_TRANSCRIPT_ID_LENGTH, description="The transcript's id.")
        ],
        after_seq: Annotated[
            SeqCursor, Field(description="Only messages after this seq: the next_after_seq of a page.")
        ] = None,
        limit: Annotated[
            int,
            Strict(),
            Field(ge=1, le=1000),
            JSON_INTEGER,
            Field(description="Messages a page holds at most."),
        ] = 100,
    ) -> dict[str, Any]:
        """An agent transcript's full history in order, a page at a time (compaction never deletes a
        message): for a history whose context view is past what one read returns."""
        transcript_id = checked_transcript_id(transcript_id)
        with refusals(), self.runtime.factory() as session:
            rows, more = list_messages(
                session, transcript_id, after_seq=after_seq, limit=limit, max_bytes=MCP_CONTEXT_MAX_BYTES
            )
            messages = [
                {
                    "seq": row.seq,
                    "role": row.role,
                    "text": row.text,
                    "tool_calls": row.tool_calls,
                    "tool_call_id": row.tool_call_id,
                    "tool_name": row.tool_name,
                    "tokens": row.tokens,
                    "created_at": row.created_at.isoformat(),
                }
                for row in rows
            ]
        next_after = messages[-1]["seq"] if more and messages else None
        return {"transcript_id": transcript_id, "messages": messages, "next_after_seq": next_after}

    def append_transcript_messages(
        self,
        transcript_id: Annotated[
            Text,
            Field(
                min_length=1,
                max_length=MAX_TRANSCRIPT_ID_LENGTH,
                description="The transcript's id (created on first use).",
            ),
        ],
        messages: Annotated[
            list[MessageIn],
            Field(min_length=1, max_length=MAX_MESSAGES_PER_REQUEST, description="The messages, in order."),
        ],
        settings: Annotated[
            dict[str, Any] | None,
            Field(
                description=(
                    "The transcript's compaction settings, as the API's append takes them: context_window "
                    "(without one no summary is ever made), reserve_tokens, keep_recent_tokens, "
                    "tool_result_limit, instructions."
                )
            ),
        ] = None,
        idempotency_key: Annotated[
            Text | None,
            Field(
                max_length=MAX_IDEMPOTENCY_KEY_LENGTH,
                description=(
                    f"A key of your own for this append (1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable "
                    "characters): sent again with the same key and messages, it is answered as before and "
                    "nothing is appended twice."
                ),
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Add messages to the end of an agent transcript. A tool result must answer a call of the
        assistant turn right before it. A compaction (summary) is queued once the context passes its
        trigger (give the transcript a context_window in settings, once)."""
        transcript_id = checked_transcript_id(transcript_id)
        raw = [m.model_dump(exclude_none=True) for m in messages]
        retrigger = self.runtime.settings.compaction_retrigger_seconds
        key = (
            clean_label(idempotency_key, MAX_IDEMPOTENCY_KEY_LENGTH) if idempotency_key is not None else None
        )
        if idempotency_key is not None and key is None:
            raise ToolError(f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable characters")

        # A key of its own route: the same key through the API is another delivery (the API's keeps the
        # raw body's digest, this one the arguments').
        scoped = scoped_key(MCP_APPEND, transcript_id, key, self.principal().sender)
        said = json.dumps({"messages": raw, "settings": settings}, sort_keys=True, ensure_ascii=False)
        within_body_cap("this append", {"messages": raw, "settings": settings}, self.runtime.settings)
        digest = hashlib.sha256(said.encode("utf-8", "surrogatepass")).hexdigest()  # refused when parsed
        with refusals():
            try:
                parsed = parse_messages(raw)
            except TranscriptError:  # a rule tightened since this append was stored: its retry replays
                prior = replayed_answer(self.runtime.factory, scoped, digest)
                if prior is None:
                    raise
                return prior | {"replayed": True}
            write = functools.partial(_append, transcript_id, parsed, settings, retrigger)
            answer, pending = deliver_once(self.runtime.factory, scoped, digest, write)
        if pending is None:
            return answer | {"replayed": True}
        try:
            sending.enqueue(self.runtime.factory, pending)  # only after the commit
        except Exception as exc:  # stored: the sweeper sends a job left queued; not the caller's failure
            logger.warning(
                "MCP append: the compaction job was not sent (%s); the sweeper sends it", type(exc).__name__
            )
        return answer

    def record_summary_feedback(
        self,
        coverage: Annotated[  # strict: true is not a coverage of 1 (the API's rule)
            float,
            Field(ge=0, le=1, allow_inf_nan=False, strict=True, description=SCORED_COVERAGE),
        ],
        answer_kept: Annotated[
            StrictBool, Field(description="Did the summarised context still let you answer correctly?")
        ],
        origin: Annotated[
            Text,
            Field(min_length=1, max_length=MAX_ORIGIN_LENGTH, description="Who judged, e.g. 'agent:me'."),
        ],
        compaction_id: Annotated[
            int,
            Strict(),
            Field(ge=1, le=BIGINT_MAX),
            JSON_INTEGER,
            Field(description="The compaction judged (get_transcript_context's compaction_id)."),
        ]
        | None = None,
        idempotency_key: Annotated[
            Text | None,
            Field(max_length=MAX_KEY_LENGTH, description="A resubmission with this key is stored once."),
        ] = None,
    ) -> dict[str, Any]:
        """Say whether a transcript summary (a compaction) kept what was needed to answer. This tunes
        the quality threshold summaries must pass."""
        settings = self.runtime.settings
        with refusals():
            observation = ObservationIn(
                coverage=coverage,
                answer_kept=answer_kept,
                origin=origin,
                compaction_id=compaction_id,
                idempotency_key=idempotency_key,
                sender=self.principal().sender,
            )
            report = add_observation(
                self.runtime.factory, observation, recompute_every=settings.calibration_recompute_every
            )
        sending.enqueue(self.runtime.factory, report.pending_jobs())  # only after the commit
        [stored] = report.stored
        return {
            "id": stored.id,
            "duplicate": stored.duplicate,
            "recompute_job_id": report.recompute.job_id if report.recompute is not None else None,
        }

    def tools(self) -> list[tuple[Callable[..., Any], Access, ToolAnnotations]]:
        """(function, access, what it does) for every tool, in the order they are listed."""
        return [
            (self.search_facts, Access("read"), READS_AND_CALLS_MODEL),
            (self.list_entity_facts, Access("read"), READS),
            (self.list_pages, Access("read"), READS),
            (self.list_page_facts, Access("read"), READS),
            (self.get_transcript_context, Access("read", "transcripts"), READS),
            (self.list_transcript_messages, Access("read", "transcripts"), READS),
            (self.append_transcript_messages, Access("ingest", "transcripts"), WRITES),
            (self.record_summary_feedback, Access("ingest", "calibration feedback"), WRITES),
        ]


__all__ = ["Access", "FactmillTools", "MessageIn", "ToolCallIn"]
