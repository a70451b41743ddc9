"""Fact embeddings: what text is embedded for a fact, and how a vector is spelled for pgvector."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "dimensions_problem",
    "fact_embedding_text",
    "vector_literal",
    "version_tuple",
]

EMBEDDING_DIMENSIONS = 256  # the vector(256) column of search.fact_embeddings


def dimensions_problem(vectors: Sequence[Sequence[float]]) -> str | None:
    """Why these vectors cannot go into (or search) the vector store, or None when they can."""
    for vector in vectors:
        if len(vector) != EMBEDDING_DIMENSIONS:
            return (
                f"the embedding model returned {len(vector)} dimensions; the vector store holds "
                f"{EMBEDDING_DIMENSIONS}. Configure an embedding model with {EMBEDDING_DIMENSIONS} "
                "dimensions."
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
