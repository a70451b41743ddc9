"""A growing list of embeddings held as matrices of unit vectors, so one new vector's cosine with all of
them is a single matrix product (numpy), not a pure-Python dot product a pair.

Consolidation planned an entity's new facts against its stored ones a pair at a time: at 50,000 facts
of one kind that was 10 s for 10 new facts (bench/consolidation_plan.py). The answers are those of
``worker.core.consolidation.cosine`` (up to float rounding): None where either vector is missing or
zero, or the two differ in length (vectors of each length are kept in a matrix of their own, so facts
embedded by two models still compare with their own model's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Block:
    """The unit vectors of one length, and the positions (in the pool) they were added at."""

    def __init__(self, dims: int, capacity: int) -> None:
        self.rows = np.zeros((capacity, dims))
        self.positions = np.zeros(capacity, dtype=np.int64)
        self.count = 0

    def append(self, unit: np.ndarray, position: int) -> None:
        if self.count == self.rows.shape[0]:  # full: double (amortized), as a list does
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self.positions = np.concatenate([self.positions, np.zeros_like(self.positions)])
        self.rows[self.count] = unit
        self.positions[self.count] = position
        self.count += 1


class VectorPool:
    """Vectors added in order; ``cosines(v)`` answers one value per vector added. ``capacity`` sizes
    the first matrix (the pool grows past it as needed)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = max(capacity, 1)
        self._blocks: dict[int, _Block] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, vector: Sequence[float] | None) -> None:
        unit = _unit(vector)
        if unit is not None:
            dims = unit.shape[0]
            if dims not in self._blocks:
                self._blocks[dims] = _Block(dims, self._capacity if not self._blocks else 16)
            self._blocks[dims].append(unit, self._count)
        self._count += 1

    def cosines(self, vector: Sequence[float] | None) -> list[float | None]:
        """The cosine of ``vector`` with each vector added so far, in order."""
        answers: list[float | None] = [None] * self._count
        unit = _unit(vector)
        block = self._blocks.get(unit.shape[0]) if unit is not None else None
        if unit is None or block is None or not block.count:
            return answers
        sims = (block.rows[: block.count] @ unit).tolist()
        for position, sim in zip(block.positions[: block.count].tolist(), sims, strict=True):
            answers[position] = sim
        return answers


def _unit(vector: Sequence[float] | None) -> np.ndarray | None:
    """The vector scaled to length 1, or None: missing, empty or zero."""
    if not vector:
        return None
    array = np.asarray(vector, dtype=np.float64)
    norm = float(np.sqrt(array @ array))
    if not norm or not np.isfinite(norm):
        return None
    return array / norm


__all__ = ["VectorPool"]
