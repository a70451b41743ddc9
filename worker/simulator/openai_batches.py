"""The OpenAI Batch API: uploaded JSONL files, /v1/batches, and the result files an ended batch writes."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Mapping
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.simulator.batches import (
    BATCH_CANCELLED_MESSAGE,
    BATCH_COMPLETION_WINDOW_SECONDS,
    BATCH_EXPIRED_MESSAGE,
    Batch,
    BatchItem,
    BatchStore,
    StoredFile,
    hold_results,
    list_limit,
    start_batch,
)
from worker.simulator.config import sim_id
from worker.simulator.openai_wire import answer_chat_completion, invalid_request, openai_error
from worker.simulator.state import state_of
from worker.simulator.wire import BadRequest, json_document, read_json


def _parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """Form fields of a multipart/form-data body: name → (filename, bytes). (Stdlib only: Starlette's own
    form parser needs python-multipart, which the service does not otherwise need.)"""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise BadRequest("The body must be multipart/form-data with a file and a purpose.")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


async def upload_file(request: Request) -> Response:
    """POST /v1/files (OpenAI): multipart upload; only purpose=batch is of use here."""
    try:
        fields = _parse_multipart(request.headers.get("content-type", ""), await request.body())
        if "file" not in fields:
            raise BadRequest("file: a file is required.", "file")
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose != "batch":
            raise BadRequest(f"purpose must be 'batch' on the simulator, not {purpose!r}.", "purpose")
    except BadRequest as exc:
        return invalid_request(exc)
    filename, content = fields["file"]
    stored = StoredFile(sim_id("file-"), filename or "upload.jsonl", purpose, content, int(time.time()))
    state_of(request).store.add_file(stored)
    return JSONResponse(stored.as_json())


def _page(data: list[dict[str, Any]], more: bool) -> Response:
    """One page of an OpenAI list, with its cursor ids."""
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def list_files(request: Request) -> Response:
    """GET /v1/files (OpenAI): newest first, ``purpose``, ``limit`` and the ``after`` cursor."""
    page, more = state_of(request).store.list_files(
        request.query_params.get("purpose"), list_limit(request, 10_000), request.query_params.get("after")
    )
    data = [stored.as_json() for stored in page]
    return _page(data, more)


async def file_content(request: Request) -> Response:
    """GET /v1/files/{file_id}/content (OpenAI)."""
    state = state_of(request)
    stored = state.store.find_file(request.path_params["file_id"])
    if stored is None:
        return openai_error(404, "No such File object.", "invalid_request_error", param="id")
    if stored.purpose == "batch_output":
        await hold_results(state)
    return Response(stored.content, media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    """DELETE /v1/files/{file_id} (OpenAI): an uploaded input or a batch's result file."""
    file_id = request.path_params["file_id"]
    if state_of(request).config.batch_delete_fails:
        return openai_error(500, "The server had an error while processing your request.", "server_error")
    if not state_of(request).store.delete_file(file_id):
        return openai_error(404, "No such File object.", "invalid_request_error", param="id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _input_lines(content: bytes) -> list[tuple[str, Mapping[str, Any]]]:
    requests: list[tuple[str, Mapping[str, Any]]] = []
    seen: set[str] = set()
    for number, line in enumerate(content.decode("utf-8").split("\n"), start=1):  # JSON Lines: "\n" only
        if not line.strip():
            continue
        entry = json_document(line, f"line {number} of the input file")
        if not isinstance(entry, dict) or not isinstance(entry.get("body"), dict):
            raise BadRequest(f"line {number}: each line needs custom_id, method, url and a body object.")
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or custom_id in seen:
            raise BadRequest(f"line {number}: custom_id must be a string, unique in the batch.")
        if entry.get("method") != "POST" or entry.get("url") != "/v1/chat/completions":
            raise BadRequest(f"line {number}: only POST /v1/chat/completions is batched by the simulator.")
        seen.add(custom_id)
        requests.append((custom_id, entry["body"]))
    if not requests:
        raise BadRequest("The input file holds no requests.")
    return requests


def _write_result_files(store: BatchStore, batch: Batch, garbled: int = 0) -> None:
    """An ended batch's output file (the 200s) and error file (the rest, and requests never run); a
    failed batch has neither, as OpenAI's has none."""
    if batch.failure is not None:
        return
    output: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for item in batch.kept():
        line = {
            "id": sim_id("batch_req_"),
            "custom_id": item.custom_id,
            "response": {"status_code": item.status, "request_id": sim_id("req_"), "body": item.body},
            "error": None,
        }
        (output if item.status == 200 else errors).append(line)
    code, message = (
        ("batch_cancelled", BATCH_CANCELLED_MESSAGE)
        if batch.cancelled_at is not None
        else ("batch_expired", BATCH_EXPIRED_MESSAGE)
    )
    for custom_id in batch.missing():
        error = {"code": code, "message": message}
        errors.append({"id": sim_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error})
    for lines, attr in ((output, "output_file_id"), (errors, "error_file_id")):
        if lines:
            texts = [json.dumps(line, ensure_ascii=False) for line in lines]
            if attr == "output_file_id":
                texts = [text[: len(text) // 2] for text in texts[:garbled]] + texts[garbled:]
            text = "".join(line + "\n" for line in texts)
            stored = StoredFile(
                sim_id("file-"), f"{batch.id}_{attr}.jsonl", "batch_output", text.encode(), int(time.time())
            )
            store.add_file(stored)
            setattr(batch, attr, stored.id)
    # The answers live in the files now, which the caller deletes: an OpenAI batch is never deleted (no
    # route does), so a long-running simulator held every answer of every batch (50,000 a backfill's).
    batch.items = [BatchItem(item.custom_id, item.status, {}) for item in batch.kept()]


def _batch_json(batch: Batch) -> dict[str, Any]:
    times = batch.times()
    if times.ended:
        status = batch.final_status()
    else:
        status = "validating" if times.age < 0.2 * batch.delay else "in_progress"
    kept = batch.kept() if times.ended else []
    completed = sum(1 for item in kept if item.status == 200)
    created, end = int(times.created), int(times.end)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": _failure_errors(batch.failure) if times.ended and batch.failure else None,
        "input_file_id": batch.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": created,
        "in_progress_at": created,
        "expires_at": created + BATCH_COMPLETION_WINDOW_SECONDS,
        "finalizing_at": end if times.ended else None,
        "completed_at": end if status == "completed" else None,
        "failed_at": end if status == "failed" else None,
        "expired_at": end if status == "expired" else None,
        "cancelling_at": end if status == "cancelled" else None,
        "cancelled_at": end if status == "cancelled" else None,
        "request_counts": {
            "total": len(batch.custom_ids),
            "completed": completed,
            "failed": len(batch.custom_ids) - completed if times.ended else 0,
        },
        "metadata": batch.metadata,
    }


def _failure_errors(code: str) -> dict[str, Any]:
    """The ``errors`` of a batch OpenAI failed as a whole (its requests never ran)."""
    message = f"The batch failed as a whole ({code}); none of its requests ran. (simulated)"
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


async def create_batch(request: Request) -> Response:
    """POST /v1/batches (OpenAI): every line of the input file is answered like /v1/chat/completions."""
    state = state_of(request)
    try:
        body = await read_json(request)
        if body.get("endpoint") != "/v1/chat/completions":
            raise BadRequest("endpoint: the simulator batches /v1/chat/completions only.", "endpoint")
        if body.get("completion_window") != "24h":
            raise BadRequest("completion_window must be '24h'.", "completion_window")
        stored = state.store.files.get(str(body.get("input_file_id")))
        if stored is None or stored.purpose != "batch":
            raise BadRequest(
                "input_file_id: no uploaded file with purpose 'batch' has that id.", "input_file_id"
            )
        requests = _input_lines(stored.content)
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise BadRequest("metadata must be an object of strings.", "metadata")
    except (BadRequest, UnicodeDecodeError) as exc:
        message = exc.message if isinstance(exc, BadRequest) else "the input file is not UTF-8"
        return openai_error(400, message, "invalid_request_error")

    def answer(one: Mapping[str, Any]) -> Awaitable[Response]:
        return answer_chat_completion(state, "batch.chat.completions", one, None, None)

    batch = await start_batch(
        state,
        "openai",
        "batch_",
        requests,
        answer,
        input_file_id=stored.id,
        on_end=functools.partial(_write_result_files, garbled=state.config.batch_garbled_lines),
        metadata=metadata,
    )
    return JSONResponse(_batch_json(batch))


async def list_batches(request: Request) -> Response:
    """GET /v1/batches (OpenAI): newest first, ``limit`` and the ``after`` cursor."""
    page, more = state_of(request).store.list_batches(
        "openai", list_limit(request, 20), request.query_params.get("after")
    )
    data = [_batch_json(batch) for batch in page]
    return _page(data, more)


def _batch_or_404(request: Request) -> Batch | Response:
    batch = state_of(request).store.find_batch(request.path_params["batch_id"], "openai")
    if batch is None:
        return openai_error(404, "No such Batch object.", "invalid_request_error", param="batch_id")
    return batch


async def retrieve_batch(request: Request) -> Response:
    """GET /v1/batches/{batch_id} (OpenAI)."""
    batch = _batch_or_404(request)
    return batch if isinstance(batch, Response) else JSONResponse(_batch_json(batch))


async def cancel_batch(request: Request) -> Response:
    """POST /v1/batches/{batch_id}/cancel (OpenAI): it ends at once with the requests done so far."""
    batch = _batch_or_404(request)
    if isinstance(batch, Response):
        return batch
    if state_of(request).config.batch_cancel_fails:
        message = f"Cannot cancel a batch with status 'completed' ({batch.id}; simulated)."
        return openai_error(400, message, "invalid_request_error")
    if batch.cancel():
        state_of(request).store.settle()
    return JSONResponse(_batch_json(batch))
