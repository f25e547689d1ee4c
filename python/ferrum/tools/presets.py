"""Model shapes: the architecture-independent config the writers share, and the named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")


@dataclass
class ModelConfig:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    # None, or HF's dict: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    attention_bias: bool = False  # q/k/v (+ o for llama) biases
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Qwen3-MoE)
    # Mixture of experts (qwen3_moe only), transformers' Qwen3MoeConfig fields: layer i is
    # sparse unless i is in mlp_only_layers, on every decoder_sparse_step-th layer; dense layers
    # use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.arch == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases (HF Qwen2 hard-codes them)")
        if self.arch != "qwen2" and self.attention_bias and self.arch != "llama":
            raise ValueError(f"{self.arch} has no attention biases in HF transformers")
        if self.qk_norm != (self.arch in ("qwen3", "qwen3_moe")):
            raise ValueError("qk_norm is exactly the qwen3 and qwen3_moe architectures")
        if self.arch == "qwen3_moe":
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError("qwen3_moe needs 1 <= num_experts_per_tok <= num_experts")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("qwen3_moe needs moe_intermediate_size > 0 and decoder_sparse_step > 0")
            if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
                raise ValueError("mlp_only_layers must be layer indices")
        elif self.num_experts:
            raise ValueError("experts are only modelled for qwen3_moe")
        if self.sliding_window is not None and self.arch != "mistral":
            raise ValueError("sliding_window is only modelled for mistral")
        if self.rope_scaling is not None:
            if self.arch not in ("llama", "mistral") or self.rope_scaling.get("rope_type") != "llama3":
                raise ValueError("only llama3 rope scaling on llama/mistral is supported")

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Arch-implied fields.
ARCH_DEFAULTS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "qwen3_moe": {"qk_norm": True, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
}

# Real shapes. vocab_size here is the config's (embedding rows); a tokenizer with fewer
# tokens is padded up to it, as the real checkpoints are.
PRESETS = {
    "tiny": dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                 intermediate_size=172, vocab_size=0, tie_word_embeddings=True,
                 rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5),
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "qwen3-0.6b": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0,
                       max_position_embeddings=40960, rms_norm_eps=1e-6),
    "tinyllama-1.1b": dict(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                           intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False,
                           rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # A synthetic Qwen3-MoE at a realistic decode shape: ~1.0B parameters in total, ~0.21B read
    # per token (4 of 32 experts, attention, the tied embedding as output).
    "qwen3-moe-1b-a0.2b": dict(hidden_size=1024, num_layers=18, num_heads=16, num_kv_heads=4,
                               head_dim=64, intermediate_size=3072, vocab_size=49152,
                               tie_word_embeddings=True, rope_theta=1000000.0,
                               max_position_embeddings=40960, rms_norm_eps=1e-6,
                               num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512),
}


def llama3_rope_scaling(factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0,
                        original_max_position_embeddings: int = 8192) -> dict:
    return {"rope_type": "llama3", "factor": float(factor),
            "low_freq_factor": float(low_freq_factor), "high_freq_factor": float(high_freq_factor),
            "original_max_position_embeddings": int(original_max_position_embeddings)}


def build_config(arch: str, preset: str, tokenizer_vocab_size: int | None, **overrides) -> ModelConfig:
    """The preset's shape for `arch`, with the vocabulary grown to fit the tokenizer and then
    any explicit overrides (ModelConfig field names) applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    preset_fields = PRESETS[preset]
    if arch != "qwen3_moe":  # an MoE preset used for a dense arch keeps its dense shape
        preset_fields = {k: v for k, v in preset_fields.items() if not k.startswith(("num_experts", "moe_"))}
    fields = {**ARCH_DEFAULTS[arch], **preset_fields}
    if tokenizer_vocab_size:
        fields["vocab_size"] = max(fields["vocab_size"], tokenizer_vocab_size)
    if isinstance(overrides.get("rope_scaling"), str):
        if overrides["rope_scaling"] != "llama3":
            raise ValueError("rope_scaling: only 'llama3' is supported")
        overrides["rope_scaling"] = llama3_rope_scaling()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown overrides: {sorted(unknown)}")
    fields.update({k: v for k, v in overrides.items() if v is not None or k in
                   ("rope_scaling", "sliding_window")})
    fields["mlp_only_layers"] = tuple(fields.get("mlp_only_layers", ()))
    if not fields["vocab_size"]:
        raise ValueError("no vocabulary size: give a tokenizer or vocab_size=")
    return ModelConfig(arch=arch, **fields)
