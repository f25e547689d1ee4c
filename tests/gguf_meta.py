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


# llama.cpp token types
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def metadata_from_tokenizer_json(directory, pre: str) -> dict:
    """The `tokenizer.ggml.*` metadata llama.cpp's converter writes for a byte-level BPE tokenizer.json:
    tokens by id, token types (added special -> control, other added -> user-defined), merges, pre name."""
    import json
    from pathlib import Path

    directory = Path(directory)
    spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    kinds = {}
    for tok in spec["added_tokens"]:
        vocab[tok["content"]] = tok["id"]
        kinds[tok["id"]] = _CONTROL if tok["special"] else _USER_DEFINED
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    assert None not in tokens, "vocabulary ids have holes"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds.get(i, _NORMAL) for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
    }
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token")):
        if isinstance(config.get(name), str):
            meta[f"tokenizer.ggml.{key}_token_id"] = vocab[config[name]]
    if isinstance(config.get("chat_template"), str):
        meta["tokenizer.chat_template"] = config["chat_template"]
    return meta
