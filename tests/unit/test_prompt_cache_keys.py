"""Prompt cache keys as providers take them: at most 64 characters, stable, naming no client id."""

from __future__ import annotations

from worker.compaction.prompts import compaction_cache_key
from worker.llm.openai_compat import PROMPT_CACHE_KEY_MAX_CHARS, OpenAIChatClient, bounded_cache_key
from worker.llm.types import ChatRequest


def test_a_key_over_openai_s_limit_is_sent_as_a_stable_digest() -> None:
    long_key = "tenant-" + "a" * 100
    bounded = bounded_cache_key(long_key)
    assert len(bounded) <= PROMPT_CACHE_KEY_MAX_CHARS == 64
    assert bounded == bounded_cache_key(long_key) != bounded_cache_key(long_key + "b")
    assert bounded_cache_key("factmill-extraction-v1-10") == "factmill-extraction-v1-10"  # fits: as is


def test_the_request_body_carries_the_bounded_key() -> None:
    client = OpenAIChatClient(model="m", api_key="k", base_url="http://127.0.0.1:9")
    request = ChatRequest("p", "s", (("user", "u"),), 10, cache_key="x" * 200)
    assert len(client.chat_body(request)["prompt_cache_key"]) <= 64


def test_a_transcript_s_cache_key_names_it_by_digest() -> None:
    transcript_id = "alice-smith-" + "0" * 150
    key = compaction_cache_key(transcript_id)
    assert len(key) <= 64 and "alice" not in key
    assert key == compaction_cache_key(transcript_id) != compaction_cache_key("bob")
