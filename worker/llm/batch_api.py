"""What a provider's batch API is to Factmill, whichever provider: the client protocol, its answers (a
batch's status, one request's result, a lookup that cannot tell yet), and how a results file is read."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from worker.llm.types import ChatRequest, ChatResponse, Usage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchItem:
    """One request's result: a response, or the error the provider answered it with."""

    response: ChatResponse | None
    error: str | None = None
    usage: Usage | None = None  # billed for a reply of the wrong shape (LLMError.usage)
    # The HTTP status the provider answered the request with (an error's), and whether its body blamed
    # the account or the settings: what the online path reads to tell a request the provider rejects
    # (it repeats, and counts towards skipping the segment) from a deployment's fault.
    status: int | None = None
    deployment_fault: bool = False


@dataclass(frozen=True)
class BatchStatus:
    id: str
    status: str  # the provider's word: completed, expired, cancelled, failed, in_progress, ended, ...
    ended: bool
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # why the provider failed the batch as a whole (OpenAI's ``errors``)

    def said(self) -> str:
        """The provider's word on the batch, with its reason when it failed the batch as a whole."""
        return self.status if self.error is None else f"{self.status}: {self.error}"


class Undetermined:
    """``find``'s answer when the provider cannot tell yet (a batch still running hides its requests)."""

    def __repr__(self) -> str:
        return "UNDETERMINED"


UNDETERMINED = Undetermined()
# How far back ``find`` looks through the provider's batch list (newest first).
FIND_LIMIT = 1000
# A batch created this long before or after its send began (or its last failed send, which moves that
# time on) is not the one sought: clocks differ, and a create that timed out may have been made minutes
# away from it. (Batches the same backfill sent within the margin still count: undecided until they end.)
FIND_MARGIN = timedelta(minutes=30)
# A batch's completion window at the providers (24 h), and an hour's margin: past it, the provider has
# ended the batch (done or expired) and billed what ran.
PROVIDER_WINDOW = timedelta(hours=25)
# How long a provider keeps a batch: Anthropic deletes one and its results after 29 days, so a batch not
# found past it is gone for good, not held under another key. (OpenAI keeps the batch object: a 404 there
# is another project's key, however old; its output files expire, a 404 the results read answers.)
PROVIDER_KEEPS = {"anthropic": timedelta(days=29)}


class BatchLLMClient(Protocol):
    """What batch extraction needs from a provider. ``results`` leaves out requests that never ran
    (the batch expired or was cancelled first): their custom ids are simply missing.

    ``key``, given to ``submit``, must begin every custom id of the batch; ``find(key)`` answers the id
    of the batch sent with it (a send whose answer was lost), None when the provider has none, or
    UNDETERMINED when it cannot tell yet."""

    provider: str
    model: str

    def submit(self, requests: Sequence[tuple[str, ChatRequest]], key: str | None = None) -> str: ...
    def find(self, key: str, since: datetime | None = None) -> str | Undetermined | None:
        """The provider's id of the batch sent under ``key`` (its send began at ``since``, if known), None
        when it holds none, UNDETERMINED when it cannot tell yet."""
        ...

    def forget_uploads(self, key: str) -> int:
        """Delete the input uploads named by ``key``: a create that failed, timed out or never ran (its
        sender killed) left them, the pages' text named nowhere; how many. Asked when ``find`` found
        no batch holding ``key``, before the batch is sent again (or cancelled)."""
        ...

    def status(self, batch_id: str) -> BatchStatus: ...
    def cancel(self, batch_id: str) -> None: ...
    def results(self, batch_id: str, requests: Mapping[str, ChatRequest]) -> dict[str, BatchItem]: ...
    def discard(self, batch_id: str) -> None:
        """Delete what the provider keeps of an ended batch: its input and result files (OpenAI), or
        the batch and its results (Anthropic). They hold page text and the facts drawn from it, which
        Factmill has committed by then; what is already gone is not an error."""
        ...


def jsonl_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines of a JSON Lines stream, read chunk by chunk. Lines end
    at b"\\n" only: a reply may hold U+2028 or U+0085 unescaped, where str.splitlines (and httpx's
    iter_lines, which follows it) would cut its line in two and the paid result be lost."""
    held: list[bytes] = []  # the line so far (a long line's chunks are joined once, at its end)
    number = 0
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            held.append(chunk[start:end])
            line, held = b"".join(held), []
            number += 1
            if line.strip():
                yield number, line.decode("utf-8", "replace")
            start = end + 1
        held.append(chunk[start:])
    tail = b"".join(held)
    if tail.strip():
        yield number + 1, tail.decode("utf-8", "replace")


def result_line(batch_id: str, number: int, text: str) -> Mapping[str, Any] | None:
    """One line of a batch's results as a JSON object, or None (with a warning) when it is not one: its
    request then has no result, as if never run, and the next run extracts its segment. One bad line
    no longer loses the batch's other results (every collection of the batch failed on it)."""
    try:
        line = json.loads(text)
    except (ValueError, RecursionError):
        line = None
    if not isinstance(line, Mapping):
        logger.warning(
            "batch %s: result line %d is not a JSON object; its request has no result", batch_id, number
        )
        return None
    return line


__all__ = [
    "FIND_LIMIT",
    "FIND_MARGIN",
    "UNDETERMINED",
    "BatchItem",
    "BatchLLMClient",
    "BatchStatus",
    "Undetermined",
    "jsonl_lines",
    "result_line",
]
