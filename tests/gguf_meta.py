"""GGUF metadata as the plain dict Tokenizer.from_gguf_metadata takes (key -> str/int/float/bool/list).

Test helper built on llama.cpp's `gguf` package; ferrum's C++ GGUF reader returns the same shape.
"""

from __future__ import annotations

import gguf


def read_gguf_metadata(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header fields (version, counts), not metadata
            continue
        value = field.contents()
        if hasattr(value, "tolist"):
            value = value.tolist()
        meta[key] = value
    return meta
