"""atheris target: GGUF tokenizer metadata, mutated a few fields at a time from real
vocabularies, must give a Tokenizer that encodes and decodes and holds what the metadata says
(each token's text, special-token ids inside the vocabulary), or a ValueError; any other
exception (KeyError, IndexError, TypeError, ...) or a tokenizer other than the metadata says is
a finding.

usage: python fuzz/fuzz_tokenizer_metadata.py [libFuzzer flags] [CORPUS_DIR ...]
       (scripts/fuzz.sh runs it; a kept finding is replayed by passing its file)
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from ferrum import _core
    from ferrum.tokenizer import Tokenizer
    from ferrum.tokenizer_backends import byte_level_alphabet

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K" / "stories260K.gguf"


def gpt2_vocabulary() -> dict:
    """A small byte-level vocabulary: the 256 byte symbols, a few merges, an end-of-text token."""
    tokens = list(byte_level_alphabet()) + ["Ġt", "he", "Ġthe", "in", "<|endoftext|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
            "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "i n"],
            "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.chat_template": "{{ messages }}"}


BASES = [_core.ModelFile(str(STORIES)).pop_tokenizer_metadata(), gpt2_vocabulary()]
SPECIAL_IDS = {f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
KEYS = sorted({k for b in BASES for k in b} | SPECIAL_IDS | {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                                                             "tokenizer.ggml.add_space_prefix"})


def random_scalar(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 6)
    if kind == 0:
        return fdp.ConsumeInt(8)
    if kind == 1:
        return fdp.PickValueInList([math.nan, math.inf, -1.0, 0.0, fdp.ConsumeFloat()])
    if kind == 2:
        return fdp.ConsumeBool()
    if kind == 3:
        return fdp.ConsumeUnicodeNoSurrogates(8)
    if kind == 4:
        return None
    if kind == 5:
        return fdp.PickValueInList([-1, 2**32 - 1, 2**31, fdp.ConsumeIntInRange(-2, 600)])
    return [fdp.ConsumeIntInRange(0, 600)]


def mutate(meta: dict, fdp: atheris.FuzzedDataProvider) -> None:
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        key = fdp.PickValueInList(KEYS)
        op = fdp.ConsumeIntInRange(0, 5)
        value = meta.get(key)
        if op == 0:
            meta.pop(key, None)
        elif op == 1:
            meta[key] = random_scalar(fdp)
        elif op == 2 and isinstance(value, list):  # shorter or longer
            n = fdp.ConsumeIntInRange(0, len(value) + 2)
            meta[key] = value[:n] + [value[-1] if value else 0] * max(0, n - len(value))
        elif op == 3 and isinstance(value, list) and value:
            value = list(value)
            value[fdp.ConsumeIntInRange(0, len(value) - 1)] = random_scalar(fdp)
            meta[key] = value
        elif op == 4 and isinstance(value, list) and value:  # a real entry somewhere else
            value = list(value)
            value[fdp.ConsumeIntInRange(0, len(value) - 1)] = value[fdp.ConsumeIntInRange(0, len(value) - 1)]
            meta[key] = value
        else:
            meta[key] = [random_scalar(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))]


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    meta = dict(BASES[fdp.ConsumeIntInRange(0, len(BASES) - 1)])
    mutate(meta, fdp)
    try:
        tok = Tokenizer.from_gguf_metadata(meta)
    except ValueError:
        return
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens) and all(tok.id_to_token(i) == t for i, t in enumerate(tokens))
    for key in SPECIAL_IDS & meta.keys():
        stored = meta[key]
        assert stored in (-1, 2**32 - 1) or 0 <= stored < len(tokens), f"{key} = {stored} was accepted"
    assert tok.bos_token_id is None or 0 <= tok.bos_token_id < len(tokens)
    ids = tok.encode(fdp.ConsumeUnicodeNoSurrogates(32))
    tok.decode(ids)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
