"""The simulator's prompt-cache rules (worker.simulator.caching): what each provider would cache and bill."""

from __future__ import annotations

import pytest

from worker.simulator.caching import (
    ANTHROPIC_LOOKBACK_BLOCKS,
    CacheLookup,
    anthropic_min_tokens,
    anthropic_prefixes,
    openai_prefixes,
)
from worker.simulator.config import SimulatorConfig
from worker.simulator.state import SimulatorState

NS = ("openai", "key", "model")


def test_openai_caches_from_1024_tokens_in_128_token_steps() -> None:
    assert openai_prefixes(NS, "x" * 4 * 1023, 1024) == []  # under the minimum: nothing
    steps = [tokens for tokens, _ in openai_prefixes(NS, "x" * (4 * 1300 + 3), 1024)]
    assert steps == [1024, 1152, 1280]


def test_openai_prefixes_match_only_a_shared_prefix() -> None:
    stable = "s" * 4 * 1100
    first = openai_prefixes(NS, stable + "segment one", 1024)
    second = openai_prefixes(NS, stable + "segment two", 1024)
    assert first[0] == second[0]  # the first 1024 tokens are the same bytes
    assert openai_prefixes(NS, "t" + stable[1:], 1024)[0] != first[0]  # a changed first byte: no match
    assert openai_prefixes(("openai", "other-key", "model"), stable, 1024)[0] != first[0]


def test_a_prompt_read_on_arrival_misses_what_a_concurrent_one_has_not_yet_written() -> None:
    state = SimulatorState(SimulatorConfig())
    prompt = openai_prefixes(NS, "s" * 4 * 1200, 1024)
    a, b = state.cache_read(prompt), state.cache_read(prompt)  # both in flight at once
    state.cache_write(prompt)
    state.cache_write(prompt)
    assert (a, b) == (0, 0)
    assert state.cache_read(prompt) == 1152


def test_anthropic_writes_marked_prefixes_of_the_minimum_and_looks_back_20_blocks() -> None:
    blocks = ["t" * 4 * 600, "s" * 4 * 600, "u" * 40]  # tools, system, a user turn
    ends = [sum(len(b) + 1 for b in blocks[: i + 1]) for i in range(len(blocks))]
    text = "".join(b + "\n" for b in blocks)
    marked_system = anthropic_prefixes(("anthropic", "m"), text, ends, [1], 1024)
    assert [tokens for tokens, _ in marked_system.writes] == [(ends[1] + 3) // 4]
    too_short = anthropic_prefixes(("anthropic", "m"), text, ends, [0], 1024)  # 600 tokens only
    assert too_short.writes == [] and too_short.lookups == []
    # A breakpoint moved to the user turn still finds the system prefix written before it.
    later = anthropic_prefixes(("anthropic", "m"), text, ends, [2], 1024)
    assert marked_system.writes[0] in later.lookups
    assert ANTHROPIC_LOOKBACK_BLOCKS == 20


def test_cache_creation_is_what_was_written_beyond_what_was_read() -> None:
    writes = [(1500, "a"), (2000, "b")]
    assert CacheLookup(0, writes).written_tokens == 2000
    assert CacheLookup(1500, writes).written_tokens == 500
    assert CacheLookup(2000, writes).written_tokens == 0
    assert CacheLookup(0, []).written_tokens == 0


@pytest.mark.parametrize(
    ("model", "configured", "minimum"),
    [
        ("claude-3-5-haiku-latest", 1024, 2048),
        ("claude-3-haiku-20240307", 1024, 2048),
        ("claude-haiku-4-5", 1024, 4096),
        ("claude-sonnet-4-5", 1024, 1024),
        ("claude-sonnet-4-6", 0, 2048),
        ("simulator-1", 0, 0),
        ("claude-3-5-haiku-latest", 3000, 3000),
    ],
)
def test_each_claude_model_caches_from_its_own_minimum(model: str, configured: int, minimum: int) -> None:
    """The simulator cached the extraction prefix (about 1,380 tokens) for the default Anthropic model,
    Claude 3.5 Haiku, which caches nothing under 2048: the caching figures it gave were not that model's."""
    assert anthropic_min_tokens(model, configured) == minimum
