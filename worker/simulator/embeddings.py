"""The simulator's embeddings: deterministic hashed bag-of-words unit vectors (pure, no I/O)."""

from __future__ import annotations

import hashlib
import math
import re
from functools import lru_cache

DEFAULT_EMBEDDING_DIMENSIONS = 256

_EMBED_WORD = re.compile(r"[^\W_]+")


@lru_cache(maxsize=65536)
def _word_buckets(word: str, dimensions: int) -> tuple[tuple[int, float], ...]:
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=16).digest()
    first = int.from_bytes(digest[0:4], "little") % dimensions
    second = int.from_bytes(digest[4:8], "little") % dimensions
    sign1 = 1.0 if digest[8] & 1 else -1.0
    sign2 = 1.0 if digest[9] & 1 else -1.0
    return ((first, sign1), (second, 0.5 * sign2))


def _stem(word: str) -> str:
    # Just enough stemming that "likes" and "like" land in the same buckets.
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def embed_text(text: str, dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector: words hashed into signed buckets, so shared words mean similar vectors."""
    if dimensions < 1:
        raise ValueError("dimensions must be at least 1")
    vector = [0.0] * dimensions
    for word in _EMBED_WORD.findall(text.lower()):
        for index, weight in _word_buckets(_stem(word), dimensions):
            vector[index] += weight
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:
        # No words at all: still a unit vector, and still a function of the text.
        index = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest(), "little")
        vector[index % dimensions] = 1.0
        return vector
    return [v / norm for v in vector]
