"""A GGUF model back to float32 HF-layout weights and its config: the input `from_dequantized`
expects, e.g. to re-quantize the real SmolLM2 Q4_1 GGUF into F16 / Q8_0 / Q4_K_M."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import quantize as Q
from .gguf_writer import GGUF_ARCH, gguf_name
from .presets import ModelConfig
from .weights import tensor_specs


def unpermute_from_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of gguf_writer.permute_for_interleaved_rope (ggml pairs -> HF rotate-half)."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def dequantize_tensor(t) -> np.ndarray:
    """A gguf.ReaderTensor -> float32 in numpy order (rows, cols)."""
    shape = tuple(int(d) for d in t.shape[::-1])
    kind = t.tensor_type.name.lower()
    data = np.asarray(t.data)
    if kind in ("f32", "f16"):
        return data.astype(np.float32).reshape(shape)
    if kind == "bf16":
        return Q.bf16_bits_to_float(data.view(np.uint16)).reshape(shape)
    if kind in Q.BLOCK_SIZES:
        return Q.dequantize(data.reshape(-1, data.shape[-1]), kind).reshape(shape)
    raise ValueError(f"{t.name}: tensor type {kind} is not supported")


def read_gguf_model(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, {HF name: float32 array}) of a llama / qwen2 / qwen3 GGUF. A `llama` GGUF
    comes back as arch "llama" (Mistral is not distinguishable in GGUF)."""
    import gguf

    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    if arch not in set(GGUF_ARCH.values()):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    if arch == "qwen3moe":
        raise ValueError("reading Qwen3-MoE GGUF weights back is not implemented")
    tensors = {t.name: t for t in r.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError("rope_freqs (llama3 rope scaling) cannot be mapped back to a config")
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    cfg = ModelConfig(
        arch=arch, hidden_size=hidden, num_layers=meta[f"{arch}.block_count"],
        num_heads=heads, num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        tie_word_embeddings="output.weight" not in tensors,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in tensors, qk_norm=arch == "qwen3",
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]))
    weights = {}
    for hf_name, shape in tensor_specs(cfg):
        g = gguf_name(hf_name)
        x = dequantize_tensor(tensors[g])
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            x = unpermute_from_interleaved_rope(x, heads if ".attn_q." in g else cfg.num_kv_heads)
        assert x.shape == shape, (g, x.shape, shape)
        weights[hf_name] = x
    return cfg, weights
