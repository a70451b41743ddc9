"""A backfill's plan as it is stored, and its batches and requests as a pass reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class PlannedRequest:
    custom_id: str
    page_id: int
    slug: str
    end_message: int
    segment_hash: str


@dataclass(frozen=True)
class PlannedBatch:
    key: str
    provider: str
    model: str
    requests: Sequence[PlannedRequest]


@dataclass(frozen=True)
class BatchRow:
    id: int
    key: str  # its send key (BackfillBatch.send_key): what the provider knows its present copy by
    status: str
    provider_batch_id: str | None
    # Seconds since its send last failed (SEND_FAILED in provider_status); None: no send failed.
    since_failed_send: float | None = None
    provider: str = ""  # where it was (or is to be) sent
    submit_started_at: datetime | None = None  # when its (last) send began
    provider_status: str | None = None  # the provider's last word on it (or why its send failed)


@dataclass(frozen=True)
class RequestRow:
    id: int
    custom_id: str
    page_id: int
    slug: str
    end_message: int
    segment_hash: str
    status: str
