"""Seed corpora for the fuzz targets: the stories260K model in its three formats plus small
generated models of every architecture variant (QK-norm, q/k/v bias, experts, quantized types).

usage: python fuzz/make_seeds.py OUT_DIR      (writes OUT_DIR/{gguf,safetensors,llama2c}/*)
"""
from __future__ import annotations

import os
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from ferrum.tools.make_model import make_model

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"

# Small shapes (a few to tens of KB each) so that mutations stay fast.
SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=64)
VARIANTS = [("llama", "f32", {}), ("llama", "q8_0", {}), ("qwen2", "f16", {}), ("qwen3", "q4_k", dict(hidden_size=256)),
            ("qwen3_moe", "f32", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
            ("mistral", "bf16", dict(sliding_window=8))]


def pack_hf(directory: Path) -> bytes:
    """The safetensors target's input: [u32 len(config.json)][config.json][model.safetensors]."""
    config = (directory / "config.json").read_bytes()
    return struct.pack("<I", len(config)) + config + (directory / "model.safetensors").read_bytes()


def llama2c_checkpoint(dim=16, hidden=32, layers=1, heads=2, kv_heads=1, vocab=32, seq_len=16) -> bytes:
    head = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab, seq_len)
    hd, kvd = dim // heads, dim // heads * kv_heads
    floats = (vocab * dim + layers * (2 * dim + dim * dim * 2 + 2 * kvd * dim + 3 * hidden * dim)
              + dim + seq_len * hd)
    return head + np.random.default_rng(0).standard_normal(floats).astype(np.float32).tobytes()


def main(out: str) -> None:
    out = Path(out)
    for t in ("gguf", "safetensors", "llama2c"):
        (out / t).mkdir(parents=True, exist_ok=True)
    (out / "gguf" / "stories260K.gguf").write_bytes((STORIES / "stories260K.gguf").read_bytes())
    (out / "safetensors" / "stories260K").write_bytes(pack_hf(STORIES / "hf-converted"))
    (out / "llama2c" / "stories260K.bin").write_bytes((STORIES / "stories260K.bin").read_bytes())
    (out / "llama2c" / "small.bin").write_bytes(llama2c_checkpoint())
    with tempfile.TemporaryDirectory() as tmp:
        for arch, dtype, extra in VARIANTS:
            shape = {**SMALL, **extra}
            name = f"{arch}-{dtype}"
            path = make_model(arch, "tiny", "gguf", dtype, seed=1, out=Path(tmp) / f"{name}.gguf", **shape)
            (out / "gguf" / name).write_bytes(path.read_bytes())
            if dtype in ("f32", "f16", "bf16"):
                d = make_model(arch, "tiny", "hf", dtype, seed=1, out=Path(tmp) / name, **shape)
                (out / "safetensors" / name).write_bytes(pack_hf(d))
    print(f"seeds in {out}: " + ", ".join(f"{t} {len(os.listdir(out / t))}" for t in ("gguf", "safetensors", "llama2c")))


if __name__ == "__main__":
    main(sys.argv[1])
