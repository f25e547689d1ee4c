"""The tensors of a model (HF names and shapes) and their seeded random values.

Each tensor is drawn from its own numpy Generator seeded by (seed, crc32(name)), so any tensor
can be produced alone, in any order, without holding the others: the HF and GGUF writers of
the same seed produce the same model, and a 1B model never has to sit in memory at once.

Scales are chosen so the random model behaves like a usable test subject:
  * projections ~ N(0, 1/fan_in) keep activations O(1) through the residual stream, and q is
    doubled so attention is visibly position- and content-dependent;
  * token embeddings are small next to the layer outputs, so the prediction is a function of
    the whole context rather than an echo of the current token;
  * the final RMSNorm gain makes the logits' spread about LOGIT_STD, so greedy decoding has
    clear winners (no near-ties that float rounding could flip);
  * MoE routers give router logits a spread of about ROUTER_LOGIT_STD, with each expert's row
    scaled by its own factor (0.5x..2x, in a seeded order): routing is peaked, and uneven as in
    trained models (large-row experts win most tokens, some experts get none).
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Iterator

import numpy as np

from .presets import ModelConfig

EMBED_STD = 0.05
LOGIT_STD = 32.0
NORM_JITTER = 0.1  # norm weights are 1 + N(0, 0.1): a missing norm weight changes the output
BIAS_STD = 0.3
ROUTER_LOGIT_STD = 2.0

WeightSource = Callable[[str], np.ndarray]


def tensor_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in HF's usual order."""
    H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    specs = [("model.embed_tokens.weight", (V, H))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (H,)),
                  (p + "self_attn.q_proj.weight", (cfg.q_size, H)),
                  (p + "self_attn.k_proj.weight", (cfg.kv_size, H)),
                  (p + "self_attn.v_proj.weight", (cfg.kv_size, H)),
                  (p + "self_attn.o_proj.weight", (H, cfg.q_size))]
        if cfg.attention_bias:
            specs += [(p + "self_attn.q_proj.bias", (cfg.q_size,)),
                      (p + "self_attn.k_proj.bias", (cfg.kv_size,)),
                      (p + "self_attn.v_proj.bias", (cfg.kv_size,))]
            if cfg.arch == "llama":  # HF Llama's attention_bias covers o_proj too; Qwen2's doesn't
                specs.append((p + "self_attn.o_proj.bias", (H,)))
        if cfg.qk_norm:
            specs += [(p + "self_attn.q_norm.weight", (cfg.head_dim,)),
                      (p + "self_attn.k_norm.weight", (cfg.head_dim,))]
        specs.append((p + "post_attention_layernorm.weight", (H,)))
        if cfg.is_moe_layer(i):
            X = cfg.moe_intermediate_size
            specs.append((p + "mlp.gate.weight", (cfg.num_experts, H)))
            for e in range(cfg.num_experts):
                specs += [(p + f"mlp.experts.{e}.gate_proj.weight", (X, H)),
                          (p + f"mlp.experts.{e}.up_proj.weight", (X, H)),
                          (p + f"mlp.experts.{e}.down_proj.weight", (H, X))]
        else:
            specs += [(p + "mlp.gate_proj.weight", (I, H)),
                      (p + "mlp.up_proj.weight", (I, H)),
                      (p + "mlp.down_proj.weight", (H, I))]
    specs.append(("model.norm.weight", (H,)))
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.weight", (V, H)))
    return specs


def _std_and_mean(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return EMBED_STD, 0.0
    if name == "model.norm.weight":
        gain = LOGIT_STD / (EMBED_STD * math.sqrt(cfg.hidden_size))
        return NORM_JITTER * gain, gain
    if name.endswith("norm.weight"):
        return NORM_JITTER, 1.0
    if name.endswith(".bias"):
        return BIAS_STD, 0.0
    if name.endswith("mlp.gate.weight"):
        return ROUTER_LOGIT_STD / math.sqrt(shape[1]), 0.0
    fan_in = shape[1]
    scale = 2.0 if name.endswith("q_proj.weight") else 1.0
    return scale / math.sqrt(fan_in), 0.0


def random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    std, mean = _std_and_mean(cfg, name, shape)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    if name.endswith("mlp.gate.weight"):  # router: per-expert scales, see the module docstring
        x *= rng.permutation(np.geomspace(0.5, 2.0, shape[0])).astype(np.float32)[:, None]
    if mean:
        x += np.float32(mean)
    return x


def random_source(cfg: ModelConfig, seed: int) -> WeightSource:
    shapes = dict(tensor_specs(cfg))
    return lambda name: random_tensor(cfg, name, shapes[name], seed)


def dict_source(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> WeightSource:
    """Weights given by HF name (e.g. a real model dequantized to float32)."""
    expected = dict(tensor_specs(cfg))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"weights missing for the config: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, config says {shape}")
    return lambda name: np.asarray(weights[name], dtype=np.float32)


def iter_tensors(cfg: ModelConfig, source: WeightSource) -> Iterator[tuple[str, np.ndarray]]:
    for name, _ in tensor_specs(cfg):
        yield name, source(name)
