"""Hugging Face checkpoint directory: config.json, model.safetensors (optionally sharded with
model.safetensors.index.json) and the tokenizer files.

Safetensors are written here, streaming: the header is computed from the shapes, then each
tensor is produced, converted and appended, so peak memory is one tensor.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

from .presets import ModelConfig
from .quantize import float_to_bf16_bits
from .tokenizer_files import TokenizerInfo, hf_tokenizer_config_for_spm
from .weights import WeightSource, tensor_specs

HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "mistral": "MistralForCausalLM"}
# dtype -> (safetensors name, bytes per element, torch_dtype name)
HF_DTYPES = {"f32": ("F32", 4, "float32"), "f16": ("F16", 2, "float16"),
             "bf16": ("BF16", 2, "bfloat16")}


def hf_config_dict(cfg: ModelConfig, dtype: str) -> dict:
    d = {
        "architectures": [HF_CLASS[cfg.arch]],
        "model_type": cfg.arch,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": HF_DTYPES[dtype][2],
    }
    if cfg.arch == "llama":
        d.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    if cfg.arch == "mistral":
        d["sliding_window"] = cfg.sliding_window
    if cfg.arch in ("qwen2", "qwen3", "qwen3_moe"):
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if cfg.arch in ("qwen3", "qwen3_moe"):
        d["attention_bias"] = False
    if cfg.arch == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                 output_router_logits=False, router_aux_loss_coef=0.001)
    return d


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f32":
        return np.ascontiguousarray(x, dtype="<f4")
    if dtype == "f16":
        return np.ascontiguousarray(x.astype("<f2"))
    return float_to_bf16_bits(x).astype("<u2")


def _plan_shards(specs, elem_bytes: int, shard_bytes: int | None) -> list[list[tuple[str, tuple]]]:
    shards, current, size = [], [], 0
    for name, shape in specs:
        n = int(np.prod(shape)) * elem_bytes
        if current and shard_bytes and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    shards.append(current)
    return shards


def _write_safetensors(path: Path, specs, source: WeightSource, dtype: str) -> int:
    st_name, elem_bytes, _ = HF_DTYPES[dtype]
    header, offset = {}, 0
    for name, shape in specs:
        n = int(np.prod(shape)) * elem_bytes
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in specs:
            x = source(name)
            assert x.shape == tuple(shape), (name, x.shape, shape)
            f.write(_encode(x, dtype).tobytes())
    return offset


def write_hf(out: Path, cfg: ModelConfig, source: WeightSource, dtype: str = "f32",
             tokenizer: TokenizerInfo | None = None, shard_bytes: int | None = None) -> Path:
    if dtype not in HF_DTYPES:
        raise ValueError(f"HF checkpoints are f32/f16/bf16, not {dtype}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "do_sample": False}, indent=2) + "\n")

    specs = tensor_specs(cfg)
    shards = _plan_shards(specs, HF_DTYPES[dtype][1], shard_bytes)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", specs, source, dtype)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_safetensors(out / fname, shard, source, dtype)
            weight_map.update({name: fname for name, _ in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer is not None:
        for f in tokenizer.hf_files():
            shutil.copyfile(f, out / f.name)
        if tokenizer.kind == "spm" and not (out / "tokenizer_config.json").exists():
            (out / "tokenizer_config.json").write_text(
                json.dumps(hf_tokenizer_config_for_spm(tokenizer), indent=2) + "\n")
    return out
