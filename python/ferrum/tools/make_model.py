"""Test-model generator: random (seeded) or given weights, written as an HF directory or a GGUF.

    python -m ferrum.tools.make_model --arch qwen3 --preset tiny --format gguf --dtype q4_k_m \\
        --seed 0 --tokenizer ../shared/models/tokenizers/qwen3-0.6b --out /tmp/qwen3-tiny.gguf

The HF directory and the GGUF of the same arguments and seed hold the same model (the GGUF
quantized when --dtype asks). See presets.py for the shapes, weights.py for the values,
gguf_writer.py for the llama.cpp conventions and quantize.py for the block formats.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from .gguf_writer import DTYPES, write_gguf
from .hf_writer import write_hf
from .presets import ARCHS, PRESETS, ModelConfig, build_config, llama3_rope_scaling
from .tokenizer_files import TokenizerInfo, load_tokenizer
from .weights import dict_source, random_source

FORMATS = ("hf", "gguf")


def _with_special_ids(cfg: ModelConfig, tok: TokenizerInfo | None) -> ModelConfig:
    if tok is None:
        return cfg
    return cfg.replace(bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id,
                       eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_token_id,
                       pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else tok.pad_token_id)


def _write(cfg, source, format, dtype, out, tok, shard_bytes, tokenizer_pre, name) -> Path:
    if format == "hf":
        return write_hf(Path(out), cfg, source, dtype, tok, shard_bytes)
    if format == "gguf":
        return write_gguf(Path(out), cfg, source, dtype, tok, tokenizer_pre, name)
    raise ValueError(f"unknown format {format!r}; expected one of {FORMATS}")


def make_config(arch: str, preset: str = "tiny", tokenizer: str | Path | None = None,
                **overrides) -> ModelConfig:
    """The config make_model would use (overrides are ModelConfig field names)."""
    tok = load_tokenizer(tokenizer) if tokenizer else None
    cfg = build_config(arch, preset, tok.size if tok else None, **overrides)
    return _with_special_ids(cfg, tok)


def make_model(arch: str, preset: str = "tiny", format: str = "hf", dtype: str = "f32",
               seed: int = 0, tokenizer: str | Path | None = None, out: str | Path = "model",
               shard_bytes: int | None = None, tokenizer_pre: str | None = None,
               **overrides) -> Path:
    """Write a random-weight model; returns the directory (hf) or file (gguf).

    overrides: any ModelConfig field, e.g. hidden_size, num_layers, num_heads, num_kv_heads,
    head_dim, intermediate_size, vocab_size, tie_word_embeddings, rope_theta,
    rope_scaling ("llama3" or HF's dict), sliding_window, attention_bias,
    max_position_embeddings, rms_norm_eps; for qwen3_moe also num_experts,
    num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
    mlp_only_layers."""
    tok = load_tokenizer(tokenizer) if tokenizer else None
    cfg = _with_special_ids(build_config(arch, preset, tok.size if tok else None, **overrides), tok)
    name = f"ferrum-random-{arch}-{preset}-seed{seed}"
    return _write(cfg, random_source(cfg, seed), format, dtype, out, tok, shard_bytes,
                  tokenizer_pre, name)


def from_dequantized(weights: dict[str, np.ndarray], config: ModelConfig, format: str = "gguf",
                     dtype: str = "f32", out: str | Path = "model",
                     tokenizer: str | Path | None = None, shard_bytes: int | None = None,
                     tokenizer_pre: str | None = None) -> Path:
    """Write given float weights (HF names, HF layout: q/k in rotate-half order) in any format
    and dtype, e.g. a real model dequantized to f32 and re-quantized to Q4_K_M."""
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if tok is not None and tok.size > config.vocab_size:
        raise ValueError(f"tokenizer has {tok.size} tokens, config vocab_size {config.vocab_size}")
    config = _with_special_ids(config, tok)
    return _write(config, dict_source(config, weights), format, dtype, out, tok, shard_bytes,
                  tokenizer_pre, f"ferrum-requantized-{config.arch}")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 2GB)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1000 ** power)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferrum.tools.make_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    p.add_argument("--format", default="hf", choices=FORMATS)
    p.add_argument("--dtype", default="f32", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer directory, tokenizer.json or tokenizer.model")
    p.add_argument("--tokenizer-pre", help="override llama.cpp's pre-tokenizer name (GGUF)")
    p.add_argument("--out", required=True, help="directory (hf) or .gguf file")
    p.add_argument("--shard-size", type=parse_size, help="hf: split safetensors, e.g. 2GB")
    p.add_argument("--tie", dest="tie_word_embeddings", action=argparse.BooleanOptionalAction,
                   default=None, help="tie the output projection to the token embedding")
    p.add_argument("--rope-scaling", choices=("llama3",))
    p.add_argument("--rope-scaling-factor", type=float, default=8.0)
    p.add_argument("--rope-low-freq-factor", type=float, default=1.0)
    p.add_argument("--rope-high-freq-factor", type=float, default=4.0)
    p.add_argument("--rope-original-max-pos", type=int, default=8192)
    p.add_argument("--sliding-window", type=int)
    p.add_argument("--attention-bias", action=argparse.BooleanOptionalAction, default=None)
    for flag in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "head-dim",
                 "intermediate-size", "vocab-size", "max-position-embeddings"):
        p.add_argument(f"--{flag}", type=int)
    for flag in ("num-experts", "num-experts-per-tok", "moe-intermediate-size", "decoder-sparse-step"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mlp-only-layers", type=lambda t: tuple(int(i) for i in t.split(",") if i),
                   help="qwen3_moe: comma-separated layers that stay dense, e.g. 0,3")
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--rms-norm-eps", type=float)
    a = p.parse_args(argv)

    overrides = {k: getattr(a, k) for k in (
        "tie_word_embeddings", "sliding_window", "attention_bias", "hidden_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
        "max_position_embeddings", "rope_theta", "rms_norm_eps", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
        if getattr(a, k) is not None}
    if a.rope_scaling:
        overrides["rope_scaling"] = llama3_rope_scaling(
            a.rope_scaling_factor, a.rope_low_freq_factor, a.rope_high_freq_factor,
            a.rope_original_max_pos)
    path = make_model(a.arch, a.preset, a.format, a.dtype, a.seed, a.tokenizer, a.out,
                      a.shard_size, a.tokenizer_pre, **overrides)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
