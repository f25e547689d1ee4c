"""Prompts given as embeddings (vLLM's ``{"prompt_embeds": array}``): float32 rows
``[tokens, hidden]`` that the model reads instead of its embedding's rows for token ids. Opt-in with
``LLM(..., enable_prompt_embeds=True)``. A generation continues from its sampled token ids; its
cached KV blocks are shared only with prompts of the same rows (never with token-id prompts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptEmbeds:
    """A checked prompt of embeddings: C-contiguous float32 [tokens, hidden], finite."""
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def prompt_embeds_of(value, hidden: int) -> PromptEmbeds:
    """ValueError unless `value` is a float32 [tokens >= 1, hidden] array (numpy, or anything with
    ``__array__`` such as a torch tensor) of finite values."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value) if hasattr(value, "__array__") else None
    if arr is None:
        raise ValueError(f"prompt_embeds must be a float32 array, got {type(value).__name__}")
    if arr.dtype != np.float32:
        raise ValueError(f"prompt_embeds must be float32, got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != hidden:
        raise ValueError(f"prompt_embeds must have shape [tokens >= 1, {hidden}], got {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError("prompt_embeds must be finite (it holds NaN or infinity)")
    return PromptEmbeds(np.ascontiguousarray(arr))
