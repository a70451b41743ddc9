"""Provider batch APIs (OpenAI Batch API, Anthropic Message Batches): submit, poll, read results."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime
from itertools import islice
from typing import Any, Generic, TypeVar

from worker.llm.anthropic_provider import AnthropicChatClient, billed_in
from worker.llm.batch_api import (
    FIND_LIMIT,
    FIND_MARGIN,
    UNDETERMINED,
    BatchItem,
    BatchLLMClient,
    BatchStatus,
    Undetermined,
    jsonl_lines,
    result_line,
)
from worker.llm.errors import LLMError, blames_deployment, body_message, to_llm_error
from worker.llm.gateway import LLMConfigurationError, provider_client
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.retry import RetryPolicy
from worker.llm.types import ChatRequest
from worker.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", OpenAIChatClient, AnthropicChatClient)
OPENAI_ENDED = frozenset({"completed", "expired", "cancelled", "failed"})


def _batch_error(batch: Any) -> str | None:
    """Why OpenAI failed a batch as a whole (a bad input line, the queued-token limit), or None. Read as
    it came (the SDK's model or plain data), at most 300 characters."""
    errors = getattr(batch, "errors", None)
    data = getattr(errors, "data", None) or []
    said = "; ".join(
        f"{getattr(e, 'code', None) or 'error'}: {getattr(e, 'message', None) or ''}".strip() for e in data
    )
    return said[:300] or None


def _delete(what: str, fn: Callable[[], object], policy: RetryPolicy) -> None:
    """A provider delete with the retry policy; a 404 (deleted already, by a run that died after) is fine."""
    try:
        _call(what, fn, policy)
    except LLMError as exc:
        if exc.status != 404:
            raise


def _upload_name(key: str | None) -> str:
    """The file name a batch's input is uploaded under (its key: how an orphaned upload is found)."""
    return f"factmill-extraction-{key}.jsonl" if key else "factmill-extraction.jsonl"


def _call(what: str, fn: Callable[[], T], policy: RetryPolicy) -> T:
    """A batch-management call (upload, create, poll, download) with the gateway's retry policy."""
    waited = 0.0
    for attempt in range(1, policy.max_attempts + 1):
        started = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, LLMError)
                else to_llm_error(exc, int((time.perf_counter() - started) * 1000))
            )
            if (
                not error.retryable
                or attempt == policy.max_attempts
                or policy.wait_budget_spent(waited, error.retry_after)
            ):
                raise error from exc
            pause = policy.delay(attempt, error.retry_after, waited)
            logger.warning("batch %s failed (%s); retrying in %.1fs", what, error, pause)
            time.sleep(pause)
            waited += pause
    raise AssertionError("unreachable")


# A batch's create is tried once: it is not idempotent (neither SDK sends an idempotency key), and a
# timeout or a 502 may come after the provider accepted it, so trying again could start (and bill) a
# second batch. A backfill's batch is "submitting" before its create, and its next pass looks it up at
# the provider by its key and sends it only if the provider has none; `extract --batch` is run again.
CREATE_ONCE = RetryPolicy(max_attempts=1)


class _ProviderBatches(Generic[C]):
    """What both batch clients hold: the chat provider whose SDK they use, and the retry policy."""

    def __init__(self, chat: C, policy: RetryPolicy | None = None) -> None:
        self.chat: C = chat
        self.provider = chat.provider
        self.model = chat.model
        self.policy = policy or RetryPolicy()
        self._sdk: Any = chat.sdk


class OpenAIBatchClient(_ProviderBatches[OpenAIChatClient]):
    """The OpenAI Batch API over /v1/chat/completions (the simulator speaks it too)."""

    def submit(self, requests: Sequence[tuple[str, ChatRequest]], key: str | None = None) -> str:
        lines = [
            json.dumps(
                {
                    "custom_id": custom_id,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": self.chat.chat_body(request),
                },
                ensure_ascii=False,
            )
            for custom_id, request in requests
        ]
        data = ("\n".join(lines) + "\n").encode("utf-8")
        # Tried once, as the create is: an upload that timed out may have been stored, and a second
        # one left the first (the pages' text) at the provider, named nowhere. A failed send is sent
        # again by the next pass (or the next `extract --batch`).
        name = _upload_name(key)
        try:
            uploaded = _call(
                "upload", lambda: self._sdk.files.create(file=(name, data), purpose="batch"), CREATE_ONCE
            )
        except LLMError as exc:
            if exc.retryable:
                logger.warning(
                    "batch input upload %s: its outcome is unknown (%s); if the provider holds it, "
                    "delete it there",
                    name,
                    exc,
                )
            raise
        try:
            batch = _call(
                "create",
                lambda: self._sdk.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    metadata={"factmill": "extraction", **({"factmill_key": key} if key else {})},
                ),
                CREATE_ONCE,
            )
        except LLMError as exc:
            self._forget_upload(uploaded.id, exc)
            raise
        return batch.id

    def _forget_upload(self, file_id: str, refused: LLMError) -> None:
        """After a failed create, delete its upload (the pages' text) when the provider refused the
        create outright; after a timeout or a 5xx the batch may exist and read it (its files go with it
        once collected), so the file is only named in the log."""
        if refused.retryable:
            logger.warning(
                "batch input file %s: the create's outcome is unknown (%s); if no batch holds it, "
                "delete it at the provider",
                file_id,
                refused,
            )
            return
        try:
            _delete("delete", lambda: self._sdk.files.delete(file_id), CREATE_ONCE)
        except LLMError as exc:
            logger.warning(
                "batch input file %s: its delete failed (%s); delete it at the provider", file_id, exc
            )

    def find(self, key: str, since: datetime | None = None) -> str | Undetermined | None:
        """The batch whose metadata carries ``key`` (OpenAI keeps a batch's metadata)."""
        listed = _call(
            "list", lambda: list(islice(self._sdk.batches.list(limit=100), FIND_LIMIT)), self.policy
        )
        for batch in listed:
            if (batch.metadata or {}).get("factmill_key") == key:
                return str(batch.id)
        return None

    def forget_uploads(self, key: str) -> int:
        name = _upload_name(key)
        listed = _call(
            "list files", lambda: list(islice(self._sdk.files.list(purpose="batch"), FIND_LIMIT)), self.policy
        )
        orphans = [upload.id for upload in listed if upload.filename == name]
        for file_id in orphans:
            _delete("file delete", functools.partial(self._sdk.files.delete, file_id), self.policy)
        return len(orphans)

    def status(self, batch_id: str) -> BatchStatus:
        batch = _call("poll", lambda: self._sdk.batches.retrieve(batch_id), self.policy)
        counts = batch.request_counts.model_dump() if batch.request_counts else {}
        return BatchStatus(batch.id, batch.status, batch.status in OPENAI_ENDED, counts, _batch_error(batch))

    def cancel(self, batch_id: str) -> None:
        _call("cancel", lambda: self._sdk.batches.cancel(batch_id), self.policy)

    def results(self, batch_id: str, requests: Mapping[str, ChatRequest]) -> dict[str, BatchItem]:
        """The results of ``requests``, streamed line by line (a batch of 50,000 results is hundreds of
        megabytes: read whole, as text, then split, a worker could run out of memory, and every retry
        downloaded the same file and died again)."""
        batch = _call("poll", lambda: self._sdk.batches.retrieve(batch_id), self.policy)
        items: dict[str, BatchItem] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                read = functools.partial(self._read_file, batch_id, file_id, requests)
                items.update(_call("download", read, self.policy))
        return items

    def _read_file(
        self, batch_id: str, file_id: str, requests: Mapping[str, ChatRequest]
    ) -> dict[str, BatchItem]:
        items: dict[str, BatchItem] = {}  # fresh on each try: a retry reads the file again
        with self._sdk.files.with_streaming_response.content(file_id) as response:
            for number, line in jsonl_lines(response.iter_bytes()):
                self._read_line(batch_id, number, line, requests, items)
        return items

    def discard(self, batch_id: str) -> None:
        batch = _call("poll", lambda: self._sdk.batches.retrieve(batch_id), self.policy)
        for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
            if file_id:
                _delete("file delete", functools.partial(self._sdk.files.delete, file_id), self.policy)

    def _read_line(
        self,
        batch_id: str,
        number: int,
        text: str,
        requests: Mapping[str, ChatRequest],
        items: dict[str, BatchItem],
    ) -> None:
        line = result_line(batch_id, number, text)
        if line is None:
            return
        custom_id = line.get("custom_id")
        response = line.get("response")
        if not isinstance(custom_id, str) or not isinstance(response, Mapping):
            return  # never ran (batch_expired, batch_cancelled): no result, the segment waits for a rerun
        if custom_id not in requests:
            return  # committed by an earlier pass: nothing to keep of it
        body = response.get("body") or {}
        if response.get("status_code") == 200:
            # Per-request latency is not reported by the Batch API; the batch's turnaround is in the log.
            try:
                items[custom_id] = BatchItem(self.chat.response_from(body, 0))
            except LLMError as exc:
                items[custom_id] = BatchItem(None, str(exc), exc.usage)
            return
        status = response.get("status_code")
        status = status if isinstance(status, int) else None
        message = body_message(
            body, "the batch's error line"
        )  # the online path's words: clipped, never a body
        items[custom_id] = BatchItem(
            None,
            f"HTTP {status}: {message}",
            status=status,
            deployment_fault=blames_deployment(body, message, status),
        )


# The HTTP status each Anthropic error type stands for (a batch's errored result names the type only).
ANTHROPIC_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


class AnthropicBatchClient(_ProviderBatches[AnthropicChatClient]):
    """Anthropic Message Batches over the Messages API."""

    def submit(self, requests: Sequence[tuple[str, ChatRequest]], key: str | None = None) -> str:
        entries: Any = [
            {"custom_id": custom_id, "params": self.chat.message_params(request)}
            for custom_id, request in requests
        ]
        batch = _call("create", lambda: self._sdk.messages.batches.create(requests=entries), CREATE_ONCE)
        return batch.id

    def find(self, key: str, since: datetime | None = None) -> str | Undetermined | None:
        """Message Batches keep no metadata: an ended batch is known by its results' custom ids (each
        begins with ``key``); while any listed batch is still running, it may be the one. Only batches
        created within FIND_MARGIN of when the send began (``since``) are looked at: any batch running
        in the workspace (other backfills', other tools', this backfill's later sends) kept the answer
        undecided, and every pass read the first result of up to a thousand ended batches."""
        listed = _call(
            "list", lambda: list(islice(self._sdk.messages.batches.list(limit=100), FIND_LIMIT)), self.policy
        )
        running = False
        for batch in listed:
            if since is not None and not since - FIND_MARGIN <= batch.created_at <= since + FIND_MARGIN:
                continue  # long before or after the send (a create is one call of minutes): not the one
            if batch.processing_status != "ended":
                running = True
                continue
            try:
                first = _call("download", functools.partial(self._first_entry, batch.id), self.policy)
            except LLMError as exc:
                if exc.retryable:
                    raise
                # Results past Anthropic's 29 days, or another tool's batch: not the one sought (whose
                # results were never read), and it must not stop every lookup (and cancel) for good.
                logger.info("batch %s: its results cannot be read (%s); not the one sought", batch.id, exc)
                continue
            # Custom ids begin with the batch's key without a copy's number (models.BackfillBatch.send_key).
            if first is not None and str(first.get("custom_id")).startswith(f"{key.partition('.')[0]}-"):
                return str(batch.id)
        return UNDETERMINED if running else None

    def forget_uploads(self, key: str) -> int:
        return 0  # Message Batches take their requests inline: nothing is uploaded apart

    def status(self, batch_id: str) -> BatchStatus:
        batch = _call("poll", lambda: self._sdk.messages.batches.retrieve(batch_id), self.policy)
        counts = batch.request_counts.model_dump()
        return BatchStatus(batch.id, batch.processing_status, batch.processing_status == "ended", counts)

    def cancel(self, batch_id: str) -> None:
        _call("cancel", lambda: self._sdk.messages.batches.cancel(batch_id), self.policy)

    def discard(self, batch_id: str) -> None:
        _delete("delete", functools.partial(self._sdk.messages.batches.delete, batch_id), self.policy)

    def results(self, batch_id: str, requests: Mapping[str, ChatRequest]) -> dict[str, BatchItem]:
        """The results of ``requests``, streamed line by line from the raw JSONL (the SDK's own reader
        stopped at the first line that was not JSON, and with it the whole collection; read whole, a
        large batch's results could take the worker's memory, on every retry)."""
        return _call("download", functools.partial(self._read_results, batch_id, requests), self.policy)

    def _read_results(self, batch_id: str, requests: Mapping[str, ChatRequest]) -> dict[str, BatchItem]:
        items: dict[str, BatchItem] = {}  # fresh on each try: a retry reads the results again
        with self._sdk.messages.batches.with_streaming_response.results(batch_id) as response:
            for number, line in jsonl_lines(response.iter_bytes()):
                entry = result_line(batch_id, number, line)
                if entry is None:
                    continue
                custom_id = str(entry.get("custom_id"))
                request = requests.get(custom_id)
                item = self._item(entry.get("result"), request) if request is not None else None
                if item is not None:
                    items[custom_id] = item
        return items

    def _first_entry(self, batch_id: str) -> Mapping[str, Any] | None:
        """The first result line that is a JSON object, streamed: ``find`` looks at up to FIND_LIMIT
        batches, and downloading each one's whole results would read gigabytes."""
        with self._sdk.messages.batches.with_streaming_response.results(batch_id) as response:
            for number, line in jsonl_lines(response.iter_bytes()):
                entry = result_line(batch_id, number, line)
                if entry is not None:
                    return entry
        return None

    def _item(self, result: object, request: ChatRequest) -> BatchItem | None:
        """One request's result; None when it never ran (expired, canceled): it waits for a rerun."""
        # With the SDK, which the chat client has imported. Built as the SDK builds a reply, online and
        # in its own batch reader (``construct_type_unchecked``), not validated: a sound, paid reply with
        # any value newer than the installed SDK knows (a usage field, a stop reason, a block type) was
        # "not a message", its facts dropped and the segment sent (and paid for) again on every pass.
        from anthropic._models import construct_type_unchecked
        from anthropic.types import Message

        result = result if isinstance(result, Mapping) else {}
        if result.get("type") == "succeeded":
            raw = result.get("message")
            if not isinstance(raw, Mapping):
                return BatchItem(None, "the provider's reply is not a message (no object)", billed_in(raw))
            try:
                message = construct_type_unchecked(value=raw, type_=Message)
                return BatchItem(self.chat.response_from(message, request, 0))
            except LLMError as exc:  # response_from's: a shape it cannot read, still billed
                return BatchItem(None, str(exc), exc.usage or billed_in(raw))
        if result.get("type") == "errored":
            error = result.get("error")
            inner = error.get("error") if isinstance(error, Mapping) else None
            inner = inner if isinstance(inner, Mapping) else {}
            kind = str(inner.get("type", "error"))
            said = (
                body_message(error, "the batch's error")
                if isinstance(error, Mapping)
                else "the request failed"
            )
            status = ANTHROPIC_ERROR_STATUS.get(kind)
            return BatchItem(
                None,
                f"{kind}: {said}",
                status=status,
                deployment_fault=blames_deployment(error, said, status),
            )
        return None


# The providers with a batch API; openai-compatible servers have none.
BATCH_PROVIDERS = ("openai", "anthropic", "simulator")


def no_batch_api(provider: str) -> str:
    return (
        f"batch mode needs FACTMILL_LLM=openai, anthropic or simulator; {provider} has no batch API "
        "(run `factmill extract` without --batch)"
    )


# A backfill's batches outlive the pass that sent them; the simulator a process starts for itself stops
# with the pass, and the next pass found every batch gone (404): the backfill ended "done", no fact read.
OWN_SIMULATOR = (
    "a backfill needs a simulator that outlives each pass of its job: set FACTMILL_SIMULATOR_URL to a "
    "running one (`factmill simulator`; `factmill demo` starts one), or use "
    "`factmill extract --batch`, which waits for its batch in one process"
)


def batch_unavailable(settings: Settings) -> str | None:
    """Why this deployment cannot run a backfill, or None: a backfill is refused up front rather than
    queued for a job that can only fail (its provider has no batch API, or it is a simulator each
    worker process starts for itself)."""
    provider = settings.resolved_llm()
    if provider not in BATCH_PROVIDERS:
        return no_batch_api(provider)
    return OWN_SIMULATOR if provider == "simulator" and not settings.simulator_url else None


def batch_client_for(provider: object, policy: RetryPolicy | None = None) -> BatchLLMClient:
    """The batch API of a gateway provider; openai-compatible servers have none."""
    if isinstance(provider, AnthropicChatClient):
        return AnthropicBatchClient(provider, policy)
    if isinstance(provider, OpenAIChatClient) and provider.provider in BATCH_PROVIDERS:
        return OpenAIBatchClient(provider, policy)
    raise LLMConfigurationError(no_batch_api(getattr(provider, "provider", type(provider).__name__)))


@contextmanager
def open_batch_client(settings: Settings, policy: RetryPolicy | None = None) -> Iterator[BatchLLMClient]:
    """The configured provider's batch API (starting the bundled simulator if that is the provider),
    retrying as ``policy`` says (the settings' policy by default)."""
    with ExitStack() as stack:
        yield batch_client_for(
            provider_client(settings, stack), policy or RetryPolicy.from_settings(settings)
        )
