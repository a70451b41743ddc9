"""Fact embeddings: what text is embedded for a fact, and how a vector is spelled for pgvector."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "fact_embedding_text",
    "vector_literal",
    "vectors_problem",
    "version_tuple",
]

EMBEDDING_DIMENSIONS = 256  # the vector(256) column of search.fact_embeddings


# pgvector stores float4: a finite float64 past this (1e39 from a misbehaving server) was refused by the
# database, a 500 where the store was asked, and a paid embedding call lost on every run.
FLOAT32_MAX = 3.4028234663852886e38


def storable_vector(vector: Sequence[float]) -> bool:
    """Whether every value is a finite number pgvector's float4 holds (a NaN or an infinity makes the
    sum one; three passes in C, not one in Python: 1,536 values a fact, a million facts a backfill)."""
    if not vector:
        return True
    return math.isfinite(sum(vector)) and max(vector) <= FLOAT32_MAX and min(vector) >= -FLOAT32_MAX


def vectors_problem(vectors: Sequence[Sequence[float]], count: int | None = None) -> str | None:
    """Why these vectors cannot go into (or search) the vector store, or None when they can: not one per
    text sent (``count``), another dimension, or a value that is not a finite number (pgvector refuses
    NaN and infinity with an error of its own, a 500 where the store was asked)."""
    if count is not None and len(vectors) != count:
        return f"the embedding model returned {len(vectors)} vectors for {count} texts"
    for vector in vectors:
        if len(vector) != EMBEDDING_DIMENSIONS:
            return (
                f"the embedding model returned {len(vector)} dimensions; the vector store holds "
                f"{EMBEDDING_DIMENSIONS}. Configure an embedding model with {EMBEDDING_DIMENSIONS} "
                "dimensions."
            )
        if not storable_vector(vector):
            return (
                "the embedding model returned a vector holding a value that is not a finite number "
                "within float32's range"
            )
    return None


def fact_embedding_text(fact: str, entity_slug: str | None) -> str:
    """What is embedded for a fact: its text, and its entity when the text does not name it."""
    if entity_slug:
        entity = entity_slug.replace("-", " ").replace("_", " ")
        if entity.lower() not in fact.lower():
            return f"{fact} ({entity})"
    return fact


def vector_literal(vector: Sequence[float]) -> str:
    """A pgvector text literal: ``[0.1,0.2,...]``."""
    return "[" + ",".join(repr(float(v)) for v in vector) + "]"


def version_tuple(version: str) -> tuple[int, ...]:
    """An extension version ("0.8.0") as numbers to compare."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])
