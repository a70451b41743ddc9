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
        if not all(math.isfinite(value) for value in vector):
            return "the embedding model returned a vector holding a value that is not a finite number"
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
