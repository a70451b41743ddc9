"""Prompt caching as the two providers bill it: OpenAI's automatic prefix cache, Anthropic's breakpoints.

Both caches hold *prefixes* of the prompt, matched byte for byte, and neither caches a prefix shorter
than its minimum (``cache_min_tokens``, 1024 by default: OpenAI and Claude Sonnet/Opus; a Claude
model that needs more is held to its own, ``anthropic_min_tokens``: 2048 for Claude 3.5 Haiku).
The simulator counts about four characters a token, so a prefix of N tokens is the first
4N characters of the flattened prompt.

- OpenAI (automatic, no markers): a prompt of at least the minimum is cached as it is processed, in
  128-token steps from the minimum up (1024, 1152, 1280, ...). A later prompt with the same model and
  ``prompt_cache_key`` reads the longest of those steps it shares, byte for byte, with one cached
  earlier: ``cached_tokens`` is always 0 or the minimum plus a multiple of 128.
- Anthropic (explicit ``cache_control`` breakpoints, at most four): the prefix up to and including a
  marked block is cached, if it reaches the minimum; the first request writes it
  (``cache_creation_input_tokens``), later ones read it (``cache_read_input_tokens``). A lookup also
  tries the block boundaries up to 20 blocks before each breakpoint, so a request whose breakpoint
  moved on still reads a prefix an earlier request wrote. Unmarked prompts are never cached.

Both: a request looks the cache up when it arrives and its prefixes become readable once it is
answered, so requests sent at the same moment all miss (and, on Anthropic, each writes).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from worker.simulator.prompt import CHARACTERS_PER_TOKEN

OPENAI_CACHE_INCREMENT_TOKENS = 128
ANTHROPIC_MAX_BREAKPOINTS = 4
ANTHROPIC_LOOKBACK_BLOCKS = 20

Digests = list[tuple[int, str]]  # (prefix tokens, digest of the prefix within its namespace)


def prefix_digests(namespace: Sequence[str], text: str, char_ends: Iterable[int]) -> Digests:
    """(tokens, digest) for the prefixes ``text[:end]`` (ends ascending), hashed incrementally."""
    digest = hashlib.sha256()
    for part in namespace:
        digest.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    out: Digests = []
    done = 0
    for end in char_ends:
        digest.update(text[done:end].encode("utf-8", "surrogatepass"))
        done = end
        out.append(((end + CHARACTERS_PER_TOKEN - 1) // CHARACTERS_PER_TOKEN, digest.hexdigest()))
    return out


def openai_prefixes(namespace: Sequence[str], text: str, min_tokens: int) -> Digests:
    """The cacheable prefixes of an OpenAI prompt: every 128-token step from the minimum to its length."""
    first = max(min_tokens, OPENAI_CACHE_INCREMENT_TOKENS)
    whole_tokens = len(text) // CHARACTERS_PER_TOKEN
    steps = range(first, whole_tokens + 1, OPENAI_CACHE_INCREMENT_TOKENS)
    return prefix_digests(namespace, text, (tokens * CHARACTERS_PER_TOKEN for tokens in steps))


@dataclass(frozen=True)
class AnthropicPrefixes:
    """What one Anthropic request may read from the cache and what it writes to it."""

    lookups: Digests  # block boundaries within the lookback of a breakpoint, long enough to be cached
    writes: Digests  # the breakpoints long enough to be cached


def anthropic_prefixes(
    namespace: Sequence[str],
    text: str,
    block_ends: Sequence[int],
    breakpoints: Sequence[int],
    min_tokens: int,
) -> AnthropicPrefixes:
    """``block_ends``: the character offset where each block ends; ``breakpoints``: indexes of the
    blocks marked ``cache_control``."""
    looked: set[int] = set()
    for index in breakpoints:
        looked.update(range(max(0, index - ANTHROPIC_LOOKBACK_BLOCKS), index + 1))
    ends = sorted({block_ends[i] for i in looked})
    by_end = dict(zip(ends, prefix_digests(namespace, text, ends), strict=True))
    lookups = [by_end[end] for end in ends if by_end[end][0] >= min_tokens]
    marked = {block_ends[i] for i in breakpoints}
    writes = [by_end[end] for end in ends if end in marked and by_end[end][0] >= min_tokens]
    return AnthropicPrefixes(lookups, writes)


# Anthropic's own minimum for the models that need more than 1024 tokens (by a word of their names):
# Claude 3 and 3.5 Haiku 2048, Haiku 4.5 and Opus 4.5 4096, Sonnet 4.6 2048. The default Anthropic model
# (claude-3-5-haiku) never cached the extraction prefix (about 1,380 tokens) that the simulator did.
_ANTHROPIC_MINIMUMS = (
    (re.compile(r"claude-3(?:-5)?-haiku"), 2048),
    (re.compile(r"claude-(?:haiku|opus)-4-5"), 4096),
    (re.compile(r"claude-opus-4-6"), 4096),
    (re.compile(r"claude-sonnet-4-6"), 2048),
)


def anthropic_min_tokens(model: str, configured: int) -> int:
    """The shortest prefix ``model`` caches: its own minimum, or the configured one if that is larger."""
    own = next((tokens for pattern, tokens in _ANTHROPIC_MINIMUMS if pattern.search(model)), 0)
    return max(own, configured)


@dataclass(frozen=True)
class CacheLookup:
    """One request's cache: the tokens it read on arrival, and the prefixes it writes once answered."""

    read_tokens: int
    writes: Digests

    @property
    def written_tokens(self) -> int:
        """Anthropic's cache_creation_input_tokens: the longest written prefix beyond what was read."""
        return max(0, max((tokens for tokens, _ in self.writes), default=0) - self.read_tokens)
