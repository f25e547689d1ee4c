"""Teacher-forced scoring: log-probabilities of known tokens from the logits rows of score
requests (``Engine.add_score``), which the scheduler runs next to generations, chunked like
prompts, sharing forwards with whatever else runs and adopting cached prefix blocks of earlier
scores, so a thousand short (context, continuation) pairs cost a few large forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class TokenLogprobs:
    """Log-probabilities of ``token_ids[i]`` given every token before it in the scored sequence.

    ``token_ids``, ``logprobs`` (float32) and ``greedy`` (bool: the model's argmax at that
    position, i.e. what greedy decoding would have produced) are aligned; ``start`` is the
    position in the scored sequence of ``token_ids[0]``.
    """
    start: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    greedy: np.ndarray

    @property
    def total(self) -> float:
        return float(self.logprobs.sum(dtype=np.float64))


class LogprobCollector:
    """Consumes a score's logits rows (positions ``start - 1 ..`` of ``token_ids``) and keeps
    only the log-probability of each next token and whether it is the argmax there."""

    def __init__(self, token_ids: Sequence[int], start: int):
        self.start = start
        self.targets = np.asarray(token_ids, dtype=np.int64)
        n = len(token_ids) - start
        self.logprobs = np.zeros(n, dtype=np.float32)
        self.greedy = np.zeros(n, dtype=bool)

    def __call__(self, positions: np.ndarray, logits: np.ndarray) -> None:
        targets = self.targets[positions + 1]
        top = logits.max(axis=1)
        # float64 sum over the vocabulary: a float32 one loses digits a perplexity needs.
        log_norm = top + np.log(np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64))
        picked = logits[np.arange(len(targets)), targets]
        at = positions + 1 - self.start
        self.logprobs[at] = (picked - log_norm).astype(np.float32)
        self.greedy[at] = logits.argmax(axis=1) == targets

    def result(self) -> TokenLogprobs:
        return TokenLogprobs(self.start, self.targets[self.start:], self.logprobs, self.greedy)


class LogitsCollector:
    """Consumes a score's logits rows into one float32 [len(token_ids), vocab] array."""

    def __init__(self, num_tokens: int, vocab: int):
        self.logits = np.empty((num_tokens, vocab), dtype=np.float32)

    def __call__(self, positions: np.ndarray, logits: np.ndarray) -> None:
        self.logits[positions] = logits

