"""Embeddings: a prompt's final hidden states (after the model's final norm), pooled into one
vector. The engine computes them as it computes a score's logits (``Engine.add_score(...,
embed=True)``); this pools the rows it hands out.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

# "last": the last prompt token's hidden state (what a decoder has read the whole prompt into);
# "mean": the mean over every prompt token; "all": every prompt token's, one row each.
POOLINGS = ("last", "mean", "all")


class PooledHiddenStates:
    """Consumes one embedding's hidden-state rows (positions ``rows_from ..`` of its prompt) and
    averages them: the last row alone for "last" pooling, every row for "mean"; "all" keeps
    every row."""

    def __init__(self, num_tokens: int, pooling: str):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.rows_from = num_tokens - 1 if pooling == "last" else 0
        self._sum: Optional[np.ndarray] = None
        self._count = 0
        self._rows: Optional[List[np.ndarray]] = [] if pooling == "all" else None

    def __call__(self, positions: np.ndarray, rows: np.ndarray) -> None:
        if self._rows is not None:
            self._rows.append(np.array(rows, dtype=np.float32))
            return
        total = rows.sum(axis=0, dtype=np.float64)
        self._sum = total if self._sum is None else self._sum + total
        self._count += len(positions)

    def embedding(self, normalize: bool = True) -> np.ndarray:
        """float32 [hidden]: the pooled state, with unit L2 norm when `normalize` ("all": float32
        [tokens, hidden], each row so)."""
        if self._rows is not None:
            rows = np.concatenate(self._rows)
            if normalize:
                norms = np.linalg.norm(rows, axis=1, keepdims=True)
                rows = rows / np.where(norms > 0, norms, 1)
            return rows.astype(np.float32)
        pooled = self._sum / self._count
        if normalize:
            norm = np.linalg.norm(pooled)
            pooled = pooled / norm if norm > 0 else pooled
        return pooled.astype(np.float32)
