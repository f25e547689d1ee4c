"""GGUF v3 file in llama.cpp's conventions, written with llama.cpp's own `gguf` package.

What makes llama.cpp compute the same function as the HF checkpoint of the same weights:
  * arch names: `llama` (also for Mistral), `qwen2`, `qwen3`, `qwen3moe`;
  * for `llama`, q/k rows are permuted from HF's rotate-half RoPE layout (each head's first
    half pairs with its second half) to ggml's interleaved-pair layout (pairs are adjacent),
    exactly as llama.cpp's converter does; qwen2/qwen3 use NEOX RoPE and are stored as is;
  * Llama-3 rope scaling is stored the converter's way: a `rope_freqs.weight` tensor of
    per-frequency divisors (no rope.scaling.* keys);
  * Qwen3-MoE experts are stacked into 3-D `ffn_{gate,up,down}_exps` tensors [E, out, in]
    (ggml ne = in, out, E) and the router `ffn_gate_inp` stays f32, as llama.cpp's converter
    and quantizer leave it. llama.cpp's qwen3moe always renormalises the top-k weights and has
    no dense layers: models with norm_topk_prob off or mlp_only_layers / decoder_sparse_step
    mixing in dense layers are written the same way (`expert_weights_norm`, per-layer
    `ffn_gate/up/down`), load in ferrum, and differ from (or fail in) llama.cpp.

Tensors are described first and then produced one at a time (generate -> permute ->
quantize -> append), so memory stays at about one tensor.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from .presets import ModelConfig
from .quantize import BLOCK_SIZES, float_to_bf16_bits, quantize, row_bytes
from .tokenizer_files import TokenizerInfo, add_vocab_to_gguf
from .weights import WeightSource, tensor_specs

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe"}

DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
          "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m", "iq4_nl", "iq4_xs")

# --dtype -> general.file_type (llama.cpp's llama_ftype); a pure k-quant is reported as the
# smallest mix of that type.
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
             "q2_k": 10, "q3_k": 11, "q4_k": 14, "q4_k_m": 15, "q5_k": 16, "q6_k": 18,
             "iq4_nl": 25, "iq4_xs": 30, "bf16": 32}

# A k-quant (or IQ4_XS) tensor whose rows are not a multiple of 256 is stored as llama.cpp's
# quantizer stores it (llama_tensor_get_type's fallback), except Q2_K/Q3_K -> Q4_0 where
# llama.cpp uses IQ4_NL. A row that is not a multiple of 32 either -> F16.
K_QUANT_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1",
                    "q6_k": "q8_0", "iq4_xs": "iq4_nl"}

_HF_TO_GGUF = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"blk.\1.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"blk.\1.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_exps.weight"),
]
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def gguf_name(hf_name: str) -> str:
    for pattern, repl in _HF_TO_GGUF:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, repl, hf_name)
    raise KeyError(hf_name)


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> ggml interleaved pairs, per head: row (h, half, i) moves to
    (h, i, half). Works for weights (rows, in) and biases (rows,)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freq_factors(cfg: ModelConfig) -> np.ndarray:
    """Per-frequency divisors of RoPE's theta that reproduce HF's llama3 inv_freq scaling:
    1 for short wavelengths, `factor` for long ones, a smooth blend in between."""
    rs = cfg.rope_scaling
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen = old_ctx / rs["low_freq_factor"]
    high_wavelen = old_ctx / rs["high_freq_factor"]
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(rs["factor"])
        else:
            smooth = (old_ctx / wavelen - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / rs["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K in a Q4_K_M mix: the first and last
    eighth and every third layer in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], dtype: str, cfg: ModelConfig) -> str:
    """The storage type of one GGUF tensor for a --dtype.

    1-D tensors (norms, biases, rope_freqs) are always f32. q4_k_m follows llama.cpp's
    Q4_K_M: Q6_K for output.weight (token_embd when the output is tied to it), and for
    attn_v / ffn_down in the layers _use_more_bits picks; Q4_K elsewhere."""
    if len(shape) == 1 or dtype == "f32" or ".ffn_gate_inp." in name:
        return "f32"
    if dtype in ("f16", "bf16"):
        return dtype
    qtype = dtype
    if dtype == "q4_k_m":
        qtype = "q4_k"
        m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down|ffn_down_exps)\.weight", name)
        if name == "output.weight" or (name == "token_embd.weight" and cfg.tie_word_embeddings):
            qtype = "q6_k"
        elif m and _use_more_bits(int(m.group(1)), cfg.num_layers):
            qtype = "q6_k"
    row = shape[-1]
    if row % BLOCK_SIZES[qtype][0]:
        qtype = K_QUANT_FALLBACK.get(qtype, qtype)
    if row % BLOCK_SIZES[qtype][0]:
        return "f16"
    return qtype


def _ggml_type(t: str):
    import gguf
    return gguf.GGMLQuantizationType[t.upper()]


def _nbytes(t: str, shape: tuple[int, ...]) -> int:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if t in ("f32",):
        return rows * shape[-1] * 4
    if t in ("f16", "bf16"):
        return rows * shape[-1] * 2
    return rows * row_bytes(t, shape[-1])


def encode_tensor(x: np.ndarray, t: str) -> np.ndarray:
    """float32 -> the bytes of storage type t (uint8)."""
    if t == "f32":
        b = np.ascontiguousarray(x, dtype="<f4")
    elif t == "f16":
        b = np.ascontiguousarray(x.astype("<f2"))
    elif t == "bf16":
        b = float_to_bf16_bits(x).astype("<u2")
    else:
        b = quantize(x, t)
    return b.reshape(-1).view(np.uint8)


def _add_metadata(w, cfg: ModelConfig, dtype: str, name: str) -> None:
    import gguf

    arch = GGUF_ARCH[cfg.arch]
    w.add_name(name)
    w.add_file_type(FILE_TYPE[dtype])
    if dtype not in ("f32", "f16", "bf16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    assert w.arch == arch


def write_gguf(out: Path, cfg: ModelConfig, source: WeightSource, dtype: str = "f32",
               tokenizer: TokenizerInfo | None = None, tokenizer_pre: str | None = None,
               name: str = "ferrum-test-model") -> Path:
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    permute = GGUF_ARCH[cfg.arch] == "llama"

    # (gguf name, shape, storage type, producer of the float32 values)
    plan = []
    if cfg.rope_scaling is not None:
        factors = llama3_rope_freq_factors(cfg)
        plan.append(("rope_freqs.weight", factors.shape, "f32", lambda: factors))
    for hf_name, shape in tensor_specs(cfg):
        g = gguf_name(hf_name)
        expert = _EXPERT.fullmatch(hf_name)
        if expert:  # all experts of this projection become one [E, out, in] tensor
            if expert.group(2) != "0":
                continue
            names = [hf_name.replace(".experts.0.", f".experts.{e}.") for e in range(cfg.num_experts)]
            shape = (cfg.num_experts, *shape)
            plan.append((g, shape, tensor_type(g, shape, dtype, cfg),
                         lambda names=names: np.stack([source(n) for n in names])))
            continue
        heads = (cfg.num_heads if ".attn_q." in g else cfg.num_kv_heads if ".attn_k." in g else 0)

        def produce(hf_name=hf_name, heads=heads):
            x = source(hf_name)
            return permute_for_interleaved_rope(x, heads) if permute and heads else x
        plan.append((g, shape, tensor_type(g, shape, dtype, cfg), produce))

    w = gguf.GGUFWriter(out, GGUF_ARCH[cfg.arch])
    _add_metadata(w, cfg, dtype, name)
    if tokenizer is not None:
        add_vocab_to_gguf(w, tokenizer, cfg.vocab_size, tokenizer_pre)
    for g, shape, t, _ in plan:
        w.add_tensor_info(g, shape, np.dtype(np.float32), _nbytes(t, shape), raw_dtype=_ggml_type(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for g, shape, t, produce in plan:
        x = produce()
        assert x.shape == tuple(shape), (g, x.shape, shape)
        w.write_tensor_data(encode_tensor(x, t))
    w.close()
    return out
