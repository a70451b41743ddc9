"""Anthropic Message Batches: /v1/messages/batches, their status and their JSONL results."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.simulator.anthropic_wire import answer_message, anthropic_error, invalid_request
from worker.simulator.batches import (
    BATCH_COMPLETION_WINDOW_SECONDS,
    Batch,
    hold_results,
    iso,
    list_limit,
    start_batch,
)
from worker.simulator.state import state_of
from worker.simulator.wire import BadRequest, read_json


def _batch_json(batch: Batch, request: Request) -> dict[str, Any]:
    times = batch.times()
    counts = {"processing": len(batch.custom_ids), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if times.ended:
        kept = batch.kept()
        succeeded = sum(1 for item in kept if item.status == 200)
        missing = len(batch.custom_ids) - len(kept)
        counts = {
            "processing": 0,
            "succeeded": succeeded,
            "errored": len(kept) - succeeded,
            "canceled": missing if batch.cancelled_at is not None else 0,
            "expired": missing if batch.cancelled_at is None else 0,
        }
    results_url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{batch.id}/results"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": "ended" if times.ended else "in_progress",
        "request_counts": counts,
        "created_at": iso(times.created),
        "expires_at": iso(times.created + BATCH_COMPLETION_WINDOW_SECONDS),
        "ended_at": iso(times.end) if times.ended else None,
        "archived_at": None,
        "cancel_initiated_at": iso(times.end) if batch.cancelled_at is not None else None,
        "results_url": results_url if times.ended else None,
    }


def _requests_of(body: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    raw = body.get("requests")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("requests: at least one request is required")
    requests: list[tuple[str, Mapping[str, Any]]] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
            raise BadRequest(f"requests.{index}: custom_id and params are required")
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or custom_id in seen:
            raise BadRequest(f"requests.{index}.custom_id: must be a string, unique in the batch")
        seen.add(custom_id)
        requests.append((custom_id, entry["params"]))
    return requests


async def create_batch(request: Request) -> Response:
    """POST /v1/messages/batches (Anthropic): each request's params are answered like /v1/messages."""
    state = state_of(request)
    try:
        requests = _requests_of(await read_json(request))
    except BadRequest as exc:
        return invalid_request(exc)

    def answer(one: Mapping[str, Any]) -> Awaitable[Response]:
        return answer_message(state, "batch.messages", one, None, None)

    batch = await start_batch(state, "anthropic", "msgbatch_", requests, answer)
    return JSONResponse(_batch_json(batch, request))


async def list_batches(request: Request) -> Response:
    """GET /v1/messages/batches (Anthropic): newest first, ``limit`` and the ``after_id`` cursor."""
    page, more = state_of(request).store.list_batches(
        "anthropic", list_limit(request, 20), request.query_params.get("after_id")
    )
    data = [_batch_json(batch, request) for batch in page]
    return JSONResponse(
        {
            "data": data,
            "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


def _batch_or_404(request: Request) -> Batch | Response:
    batch = state_of(request).store.find_batch(request.path_params["batch_id"], "anthropic")
    if batch is None:
        return anthropic_error(404, "not_found_error", "No message batch has that id.")
    return batch


async def retrieve_batch(request: Request) -> Response:
    """GET /v1/messages/batches/{batch_id} (Anthropic)."""
    batch = _batch_or_404(request)
    return batch if isinstance(batch, Response) else JSONResponse(_batch_json(batch, request))


async def cancel_batch(request: Request) -> Response:
    """POST /v1/messages/batches/{batch_id}/cancel (Anthropic): it ends at once with the requests done."""
    batch = _batch_or_404(request)
    if isinstance(batch, Response):
        return batch
    if state_of(request).config.batch_cancel_fails:
        return invalid_request(BadRequest(f"Batch {batch.id} has ended and cannot be cancelled (simulated)."))
    batch.cancel()
    return JSONResponse(_batch_json(batch, request))


async def delete_batch(request: Request) -> Response:
    """DELETE /v1/messages/batches/{batch_id} (Anthropic): the batch and its results; a batch still
    processing must be cancelled (and have ended) first."""
    batch = _batch_or_404(request)
    if isinstance(batch, Response):
        return batch
    if state_of(request).config.batch_delete_fails:
        return anthropic_error(500, "api_error", "Internal server error")
    if not batch.ended(time.monotonic()):
        return anthropic_error(
            400, "invalid_request_error", "The batch is still processing; cancel it before deleting it."
        )
    state_of(request).store.delete_batch(batch.id)
    return JSONResponse({"id": batch.id, "type": "message_batch_deleted"})


async def batch_results(request: Request) -> Response:
    """GET /v1/messages/batches/{batch_id}/results (Anthropic): JSONL, one result per request."""
    batch = _batch_or_404(request)
    if isinstance(batch, Response):
        return batch
    if not batch.ended(time.monotonic()):
        return anthropic_error(400, "invalid_request_error", "The batch is still processing.")
    if batch.id in state_of(request).config.batch_results_gone:
        return anthropic_error(404, "not_found_error", "The batch's results are no longer available.")
    await hold_results(state_of(request))
    lines = []
    for item in batch.kept():
        result: dict[str, Any]
        if item.status == 200:
            result = {"type": "succeeded", "message": item.body}
        else:
            error = {k: v for k, v in item.body.items() if k in ("type", "error", "request_id")}
            result = {"type": "errored", "error": error}
        lines.append({"custom_id": item.custom_id, "result": result})
    missing = "canceled" if batch.cancelled_at is not None else "expired"
    lines += [{"custom_id": c, "result": {"type": missing}} for c in batch.missing()]
    texts = [json.dumps(line, ensure_ascii=False) for line in lines]
    garbled = state_of(request).config.batch_garbled_lines
    texts = [text[: len(text) // 2] for text in texts[:garbled]] + texts[garbled:]
    return Response("".join(text + "\n" for text in texts), media_type="application/binary")
