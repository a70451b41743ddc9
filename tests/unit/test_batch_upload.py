"""A refused batch create: its upload (the pages' text) is deleted; after an unknown outcome, kept."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from worker.llm.batches import OpenAIBatchClient
from worker.llm.errors import LLMError
from worker.llm.types import ChatRequest

REQUEST = ChatRequest(purpose="extraction", system="s", messages=(("user", "segment"),), max_tokens=16)


class FakeSDK:
    """The OpenAI SDK's files and batches, as far as a submit reaches them."""

    def __init__(self, create_error: Exception, upload_error: Exception | None = None) -> None:
        self.deleted: list[str] = []
        self.create_calls = 0
        self.uploads: list[str] = []
        self.create_error = create_error
        self.upload_error = upload_error
        self.files = SimpleNamespace(create=self._upload, delete=self.deleted.append)
        self.batches = SimpleNamespace(create=self._create)

    def _upload(self, *, file: tuple[str, bytes], purpose: str) -> Any:
        self.uploads.append(file[0])
        if self.upload_error is not None:
            raise self.upload_error
        return SimpleNamespace(id="file-1")

    def _create(self, **_: Any) -> Any:
        self.create_calls += 1
        raise self.create_error


def client(sdk: FakeSDK) -> OpenAIBatchClient:
    chat = SimpleNamespace(
        provider="openai", model="gpt-4o-mini", sdk=sdk, chat_body=lambda request: {"model": "m"}
    )
    return OpenAIBatchClient(chat)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "deleted"),
    [
        (LLMError("HTTP 400: bad input file", retryable=False, status=400), ["file-1"]),  # refused outright
        (LLMError("HTTP 500: boom", retryable=True, status=500), []),  # the batch may exist and read it
    ],
)
def test_a_refused_create_deletes_its_upload_and_an_unknown_one_keeps_it(
    error: LLMError, deleted: list[str]
) -> None:
    sdk = FakeSDK(error)
    with pytest.raises(LLMError):
        client(sdk).submit([("seg-1", REQUEST)])
    assert sdk.create_calls == 1  # a create is tried once (a retry could start a second batch)
    assert sdk.deleted == deleted


def test_an_upload_is_tried_once_and_named_by_its_batch_key() -> None:
    """An upload that timed out may have been stored: a retry uploaded the pages' text a second time and
    left the first copy at the provider, named nowhere. It is tried once (the next pass sends again) and
    its file is named by the batch's key, so an operator can find a copy left behind."""
    sdk = FakeSDK(AssertionError("no create"), upload_error=LLMError("timed out", retryable=True))
    with pytest.raises(LLMError, match="timed out"):
        client(sdk).submit([("bf-7-1:seg-1", REQUEST)], key="bf-7-1")
    assert sdk.uploads == ["factmill-extraction-bf-7-1.jsonl"] and sdk.create_calls == 0


def test_result_lines_are_read_chunk_by_chunk_and_end_at_newlines_only() -> None:
    """A results file is streamed (read whole, a large batch's took the worker's memory on every retry);
    a chunk may end inside a line or a character, and only b"\\n" ends a line (U+2028 is text)."""
    from worker.llm.batch_api import jsonl_lines

    text = '{"a": "x\u2028y"}\n\n{"b": "é\u0085"}\r\n{"c": 1}'.encode()
    for size in (1, 2, 3, 7, len(text)):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        assert list(jsonl_lines(chunks)) == [
            (1, '{"a": "x\u2028y"}'),
            (3, '{"b": "é\u0085"}\r'),
            (4, '{"c": 1}'),
        ]
    assert list(jsonl_lines([])) == [] and list(jsonl_lines([b"\n \n"])) == []
