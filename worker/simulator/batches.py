"""The batch store both wire formats share: uploaded files, batches, and answering a batch's requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from worker.simulator.config import sim_id

if TYPE_CHECKING:
    from worker.simulator.state import SimulatorState

BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
BATCH_CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
BATCH_COMPLETION_WINDOW_SECONDS = 24 * 3600

# One batched request answered as the online route would answer its body.
AnswerOne = Callable[[Mapping[str, Any]], Awaitable[Response]]
# What a wire format does once when one of its batches has ended (OpenAI writes its result files).
OnEnd = Callable[["BatchStore", "Batch"], None]


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass
class BatchItem:
    custom_id: str
    status: int  # the HTTP status the online route answered with
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchTimes:
    """A batch's clock as a status report shows it."""

    age: float  # seconds since creation
    created: float  # creation, on the wall clock
    ended: bool
    end: float  # when it ends (or ended, or was cancelled), on the wall clock


@dataclass
class Batch:
    """One batch. Every request is answered when the batch is created (that is when the seeded faults are
    drawn, in request order); the clock only decides how much of that the batch shows."""

    id: str
    wire: str  # "openai" | "anthropic"
    created_at: float
    delay: float
    custom_ids: list[str]
    items: list[BatchItem]  # answered requests, in order: fewer than custom_ids when the batch expires
    expire: bool
    input_file_id: str | None = None
    endpoint: str = "/v1/chat/completions"
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    on_end: OnEnd | None = field(default=None, repr=False)
    settled: bool = False  # on_end has run
    metadata: dict[str, str] | None = None
    failure: str | None = None  # the error code of a batch that failed before running any request

    def ended(self, now: float) -> bool:
        return self.cancelled_at is not None or now - self.created_at >= self.delay

    def kept(self) -> list[BatchItem]:
        """The answered requests the batch ends with: all, or (cancelled) the share done by then."""
        if self.cancelled_at is None:
            return self.items
        share = 1.0 if self.delay <= 0 else min(1.0, (self.cancelled_at - self.created_at) / self.delay)
        return self.items[: int(len(self.custom_ids) * share)]

    def missing(self) -> list[str]:
        """The custom ids the batch ends without a result for (expired, or not reached before a cancel)."""
        return self.custom_ids[len(self.kept()) :]

    def final_status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.cancelled_at is not None:
            return "cancelled"
        return "expired" if self.expire else "completed"

    def times(self) -> BatchTimes:
        now = time.monotonic()
        wall = time.time() - (now - self.created_at)  # the creation time on the wall clock
        end = wall + (self.delay if self.cancelled_at is None else self.cancelled_at - self.created_at)
        return BatchTimes(now - self.created_at, wall, self.ended(now), end)

    def cancel(self) -> bool:
        """End the batch now with the requests done so far; False if it had already ended."""
        now = time.monotonic()
        if self.ended(now):
            return False
        self.cancelled_at = now
        return True


class BatchStore:
    """Uploaded files and batches. They live as long as the simulator (a reset only zeroes the stats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, Batch] = {}

    def add_file(self, stored: StoredFile) -> None:
        with self._lock:
            self.files[stored.id] = stored

    def add_batch(self, batch: Batch) -> None:
        with self._lock:
            self.batches[batch.id] = batch

    def end_all(self) -> int:
        """End every running batch now (its full share answered, as at its planned end)."""
        now = time.monotonic()
        ended = 0
        with self._lock:
            for batch in self.batches.values():
                if not batch.ended(now):
                    batch.delay = now - batch.created_at
                    ended += 1
        return ended

    def settle(self) -> None:
        """Run the end hook of every batch that has ended since the last look (once each)."""
        now = time.monotonic()
        for batch in list(self.batches.values()):
            if batch.on_end is None or batch.settled or not batch.ended(now):
                continue
            batch.settled = True
            batch.on_end(self, batch)

    def find_file(self, file_id: str) -> StoredFile | None:
        self.settle()
        return self.files.get(file_id)

    def held(self) -> dict[str, int]:
        """What the store keeps: files (uploads and results), batches, and the answers batches hold."""
        with self._lock:
            answers = sum(1 for batch in self.batches.values() for item in batch.items if item.body)
            return {"files": len(self.files), "batches": len(self.batches), "answers": answers}

    def delete_file(self, file_id: str) -> bool:
        """Forget an uploaded or result file; False if there was none."""
        self.settle()
        with self._lock:
            return self.files.pop(file_id, None) is not None

    def delete_batch(self, batch_id: str) -> None:
        """Forget a batch (its result files stay, as at OpenAI; Anthropic's results go with the batch)."""
        with self._lock:
            self.batches.pop(batch_id, None)

    def list_batches(self, wire: str, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """One page of a wire's batches, newest first, after the one with id ``after``; and whether
        more follow."""
        self.settle()
        with self._lock:
            newest_first = [b for b in reversed(self.batches.values()) if b.wire == wire]
        if after is not None:
            ids = [b.id for b in newest_first]
            newest_first = newest_first[ids.index(after) + 1 :] if after in ids else []
        return newest_first[:limit], len(newest_first) > limit

    def list_files(self, purpose: str | None, limit: int, after: str | None) -> tuple[list[StoredFile], bool]:
        """One page of the files (of ``purpose``, if given), newest first, after the one with id ``after``;
        and whether more follow."""
        self.settle()
        with self._lock:
            newest_first = [f for f in reversed(self.files.values()) if purpose in (None, f.purpose)]
        if after is not None:
            ids = [f.id for f in newest_first]
            newest_first = newest_first[ids.index(after) + 1 :] if after in ids else []
        return newest_first[:limit], len(newest_first) > limit

    def find_batch(self, batch_id: str, wire: str) -> Batch | None:
        self.settle()
        batch = self.batches.get(batch_id)
        return batch if batch is not None and batch.wire == wire else None


async def start_batch(
    state: SimulatorState,
    wire: str,
    id_prefix: str,
    requests: Sequence[tuple[str, Mapping[str, Any]]],
    answer: AnswerOne,
    *,
    input_file_id: str | None = None,
    on_end: OnEnd | None = None,
    metadata: dict[str, str] | None = None,
) -> Batch:
    """Answer each batched request exactly as the online route would (seeded faults included), in order,
    and keep the batch. With batch_expire on, only the first batch_expire_share is answered. The batch
    is stored before the create is answered (batch_create_hold_seconds later)."""
    config = state.config
    expire = config.batch_expire
    failure = config.batch_fail if wire == "openai" else None
    answered = requests[: int(len(requests) * config.batch_expire_share)] if expire else requests
    if failure is not None:
        answered = []
    items = []
    for custom_id, body in answered:
        response = await answer(body)
        items.append(BatchItem(custom_id, response.status_code, json.loads(bytes(response.body))))
    batch = Batch(
        id=sim_id(id_prefix),
        wire=wire,
        created_at=time.monotonic(),
        delay=state.config.batch_delay_seconds,
        custom_ids=[custom_id for custom_id, _ in requests],
        items=items,
        expire=expire,
        input_file_id=input_file_id,
        on_end=on_end,
        metadata=metadata,
        failure=failure,
    )
    state.store.add_batch(batch)
    state.record_batch(len(requests))
    await hold(state, "batch_create_hold_seconds")
    return batch


async def hold(state: SimulatorState, knob: str) -> None:
    """Wait while the knob (seconds, read live) says to: turning it down lets held calls go at once."""
    started = time.monotonic()
    while time.monotonic() - started < float(getattr(state.config, knob)):
        await asyncio.sleep(0.05)


async def hold_results(state: SimulatorState) -> None:
    """Count a download of batch results and hold it for batch_results_hold_seconds."""
    state.record_results_download()
    await hold(state, "batch_results_hold_seconds")


def list_limit(request: Request, default: int) -> int:
    """The ``limit`` query parameter of a list route, within 1..1000."""
    try:
        return max(1, min(1000, int(request.query_params.get("limit", default))))
    except ValueError:
        return default


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
