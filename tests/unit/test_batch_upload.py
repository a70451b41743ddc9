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

    def __init__(self, create_error: Exception) -> None:
        self.deleted: list[str] = []
        self.create_calls = 0
        self.create_error = create_error
        self.files = SimpleNamespace(
            create=lambda **_: SimpleNamespace(id="file-1"), delete=self.deleted.append
        )
        self.batches = SimpleNamespace(create=self._create)

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
