"""LoRA adapters per request, as vLLM serves them: ``LoRARequest`` names an adapter (a PEFT
directory: ``adapter_config.json`` + ``adapter_model.safetensors``, or a llama.cpp GGUF adapter:
``convert_lora_to_gguf.py``'s output); the model loads it on first use and keeps it in a
host-memory LRU (``max_cpu_loras``).

Both formats become the same per-module updates (PEFT's module names, q/k rows in the base's
order), which map onto the decoder's projections: q/k/v fill their columns of the fused qkv
output, gate/up theirs of gate_up; o and down as they are. What ferrum does not apply (DoRA,
``modules_to_save``, ``lora_bias``, embedding / lm_head / router / expert targets, aLoRA) is
refused when the adapter loads, never silently skipped.

A and B stay in the dtype the file stores them in (f32, f16, bf16; llama.cpp's q8_0), or the one
``lora_dtype`` asks for; kernels read them as the f32 values they stand for. A request may scale
its adapter (``LoRARequest(..., scale=)``) on top of the file's alpha / r.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"
GGUF_SUFFIX = ".gguf"

# Decoder projection sites (cpp/model/lora.h): layer * SITES_PER_LAYER + site.
SITES_PER_LAYER = 4
SITE_QKV, SITE_O, SITE_GATE_UP, SITE_DOWN = range(4)

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's ``LoRARequest``): ``lora_name`` (what the server lists),
    ``lora_int_id`` (>= 1, the cache's key: one id is one adapter), ``lora_path`` (a PEFT adapter
    directory or a llama.cpp ``.gguf`` adapter file). ``scale`` (llama.cpp's per-request scale, a
    finite number, default 1) multiplies the adapter's update on top of its alpha / r scaling: 0
    gives the base model's output, and requests on one adapter with different scales share its
    loaded copy and run in one step."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path must name an adapter directory or .gguf file, got {self.lora_path!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real) or not math.isfinite(self.scale) \
                or abs(self.scale) > _F32_MAX:
            raise ValueError(f"the LoRA scale must be a finite number (within float32's range), got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return str(self.lora_path)


_F32_MAX = float(np.finfo(np.float32).max)

# ---- how adapters are kept ----
# LLM(lora_dtype=...) -> the dtype A and B are kept in (None: as the file stores them).
LORA_DTYPES = {"auto": None, "float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}
_Q8_0_BLOCK = 32


class LoraMatrix(NamedTuple):
    """A or B as an adapter keeps it: ``dtype`` ("f32", "f16", "bf16" or "q8_0"), ``shape``
    (rows, cols) and ``data``, its raw bytes (a uint8 array)."""
    dtype: str
    shape: Tuple[int, int]
    data: np.ndarray

    def values(self) -> np.ndarray:
        """The f32 values it stands for, [rows, cols]."""
        from . import _core
        return _core.quant.dequantize(self.dtype, self.data, self.shape[0] * self.shape[1]).reshape(self.shape)


def lora_storage(lora_dtype: str) -> Optional[str]:
    """The storage dtype ``lora_dtype`` names (None for "auto"); ValueError for another name."""
    if lora_dtype not in LORA_DTYPES:
        raise ValueError(f"lora_dtype must be one of {', '.join(map(repr, LORA_DTYPES))}, got {lora_dtype!r}")
    return LORA_DTYPES[lora_dtype]


def _stored(values: np.ndarray, dtype: str, source: str, name: str) -> LoraMatrix:
    """values (f32, exactly representable in `dtype` when the file stored them so) kept in
    `dtype`; q8_0 keeps rows that are not whole blocks in f16, as llama.cpp's converter does."""
    from . import _core
    rows, cols = values.shape
    if dtype == "q8_0" and cols % _Q8_0_BLOCK:
        dtype = "f16"
    m = LoraMatrix(dtype, (rows, cols), _core.quant.quantize(dtype, np.ascontiguousarray(values, np.float32).ravel()))
    if dtype != "f32" and not np.isfinite(m.values()).all():
        raise ValueError(f"{source}: tensor {name} has values outside {dtype}'s range (lora_dtype)")
    return m


# ---- safetensors, read with numpy (the format: u64 header size, JSON header, raw data) ----
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path: Path, dtypes: Optional[Dict[str, str]] = None) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (and into `dtypes`, when given, the dtype
    each is stored in: "f32" for F64 and F32, "f16", "bf16"). ValueError for a damaged file or a
    dtype other than f64 / f32 / f16 / bf16."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: not a safetensors file (header size {n} past the end)")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: damaged safetensors header")
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a damaged header entry") from None
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}; adapters are read in F64, F32, F16 or BF16")
        np_dtype = np.dtype(_ST_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        if not (0 <= begin <= end <= len(body)) or end - begin != count * np_dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has data offsets that do not fit its shape or the file")
        a = np.frombuffer(body[begin:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32)
        if dtypes is not None:
            dtypes[name] = {"F16": "f16", "BF16": "bf16"}.get(dtype, "f32")
    return out


# ---- PEFT's config semantics ----
def _match_target(module: str, targets) -> bool:
    """PEFT's target_modules: a regex (full match on the module name) or names matched as the
    module name or its suffix after a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _pattern_value(patterns: dict, module: str, default):
    """rank_pattern / alpha_pattern: the first key that names the module (or a suffix of it after
    a dot), read as a regex, as PEFT matches them."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(config: dict, field: str, kind=float, zero=False, source=CONFIG_FILE):
    """config[field], a positive int or number (or zero, with `zero`); ValueError naming `source`
    and the field for anything else."""
    v = config.get(field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
            or not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise ValueError(f"{source}: {field} must be a {'non-negative' if zero else 'positive'} "
                         f"{'integer' if kind is int else 'number'}, got {v!r}")
    return v


def _module_names(cfg: dict) -> Dict[str, Tuple[str, int, str]]:
    """The base model's linear modules as PEFT names them: name -> (kind, layer, projection),
    kind "ok" for what ferrum applies, else the feature that it refuses."""
    names = {"model.embed_tokens": ("embedding targets", -1, ""), "lm_head": ("lm_head targets", -1, "")}
    moe = set(cfg.get("moe_layers") or [])
    for layer in range(cfg["num_layers"]):
        base = f"model.layers.{layer}"
        for p in _ATTN:
            names[f"{base}.self_attn.{p}"] = ("ok", layer, p)
        if layer in moe:
            names[f"{base}.mlp.gate"] = ("router targets", layer, "")
            for e in range(cfg["num_experts"]):
                for p in _MLP:
                    names[f"{base}.mlp.experts.{e}.{p}"] = ("expert targets", layer, "")
        else:
            for p in _MLP:
                names[f"{base}.mlp.{p}"] = ("ok", layer, p)
    return names


def _projection(cfg: dict, proj: str) -> Tuple[int, int, int, int]:
    """(site, first output column, out_features, in_features) of one PEFT projection."""
    h, q, kv, inter = (cfg["hidden_size"], cfg["num_heads"] * cfg["head_dim"],
                       cfg["num_kv_heads"] * cfg["head_dim"], cfg["intermediate_size"])
    return {
        "q_proj": (SITE_QKV, 0, q, h), "k_proj": (SITE_QKV, q, kv, h), "v_proj": (SITE_QKV, q + kv, kv, h),
        "o_proj": (SITE_O, 0, h, q), "gate_proj": (SITE_GATE_UP, 0, inter, h),
        "up_proj": (SITE_GATE_UP, inter, inter, h), "down_proj": (SITE_DOWN, 0, h, inter),
    }[proj]


def _reorder_rope_rows(b: np.ndarray, heads: int, to_interleaved: bool) -> np.ndarray:
    """B's q/k output rows between HF's order (each head's halves [0, d/2) and [d/2, d)) and the
    one llama.cpp's converter permutes Llama's into (RoPE pairs (i, d/2 + i) interleaved)."""
    n, r = b.shape
    split = (heads, 2, n // heads // 2, r) if to_interleaved else (heads, n // heads // 2, 2, r)
    return b.reshape(split).swapaxes(1, 2).reshape(n, r)


class _Pair(NamedTuple):
    """One projection an adapter updates, as read from its file: `module` is PEFT's name for it,
    `label` what messages call it; `a` and `b` as f32, stored in `a_dtype` / `b_dtype`; q/k rows
    of `b` in HF's order unless the reader says otherwise."""
    module: str
    label: str
    a_name: str
    a: np.ndarray
    b_name: str
    b: np.ndarray
    rank: int
    scale: float
    a_dtype: str = "f32"
    b_dtype: str = "f32"


def _updates(pairs: List[_Pair], cfg: dict, max_rank: int, source: str, interleaved: bool,
             storage: Optional[str] = None) -> List[tuple]:
    """The runner's updates [(site, A, B, out_col, scale)] of `pairs` for a model of config `cfg`,
    A and B LoraMatrix in `storage` (None: as stored): ValueError, naming the tensor, for a rank
    over max_rank, a shape the base does not have or non-finite values. interleaved: q/k rows of
    B come in llama.cpp's interleaved order."""
    modules = _module_names(cfg)
    base_interleaved = cfg.get("rope_layout") == "interleaved"
    updates = []
    for p in pairs:
        _, layer, proj = modules[p.module]
        site, col, out_f, in_f = _projection(cfg, proj)
        if p.rank > max_rank:
            raise ValueError(f"{p.label}: rank {p.rank} is more than max_lora_rank {max_rank}")
        for name, t, want in ((p.a_name, p.a, (p.rank, in_f)), (p.b_name, p.b, (out_f, p.rank))):
            if t.shape != want:
                raise ValueError(f"{source}: tensor {name} is {list(t.shape)}, the base model needs {list(want)}")
        for name, t in ((p.a_name, p.a), (p.b_name, p.b)):
            if not np.isfinite(t).all():
                raise ValueError(f"{source}: tensor {name} has non-finite values")
        b = p.b
        if proj in ("q_proj", "k_proj") and interleaved != base_interleaved:
            b = _reorder_rope_rows(b, cfg["num_heads"] if proj == "q_proj" else cfg["num_kv_heads"], base_interleaved)
        updates.append((layer * SITES_PER_LAYER + site, _stored(p.a, storage or p.a_dtype, source, p.a_name),
                        _stored(b, storage or p.b_dtype, source, p.b_name), col, float(p.scale)))
    return updates


_REFUSED_FLAGS = (("use_dora", "DoRA (use_dora)"), ("lora_bias", "lora_bias"),
                  ("modules_to_save", "modules_to_save"), ("layer_replication", "layer_replication"),
                  ("target_parameters", "target_parameters"), ("trainable_token_indices", "trainable_token_indices"),
                  ("alora_invocation_tokens", "aLoRA (alora_invocation_tokens)"), ("use_qalora", "QALoRA"))


def read_peft_adapter(path, cfg: dict, max_rank: int, storage: Optional[str] = None) -> List[tuple]:
    """A PEFT LoRA directory as the runner's updates [(site, A, B, out_col, scale)] for a model of
    config `cfg` (ModelRunner.config), A and B kept in `storage` (None: the file's dtype).
    ValueError, naming the field or tensor, for anything ferrum would not apply exactly as PEFT
    does."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a PEFT adapter directory")
    weights = path / WEIGHTS_FILE
    if not weights.exists():
        if (path / PICKLED_FILE).exists():
            raise ValueError(f"{path / PICKLED_FILE}: pickled adapters run code when loaded and are refused; "
                             f"save the adapter as {WEIGHTS_FILE} (save_pretrained(..., safe_serialization=True))")
        raise ValueError(f"{path}: no {WEIGHTS_FILE}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {CONFIG_FILE}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_FILE}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for field, feature in _REFUSED_FLAGS:
        if config.get(field):
            raise ValueError(f"adapter_config.json: {feature} is not supported")
    r = _number(config, "r", int)
    alpha = _number(config, "lora_alpha")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"adapter_config.json: use_rslora must be true or false, got {rslora!r}")
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        p = config.get(field) or {}
        if not isinstance(p, dict):
            raise ValueError(f"adapter_config.json: {field} must be an object, got {p!r}")
        patterns[field] = p
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets == "all-linear":
        targets = None
    elif not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                           and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"adapter_config.json: target_modules must be a list of names, a regex or 'all-linear', "
                         f"got {targets!r}")
    excluded = config.get("exclude_modules") or []
    layers = config.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(x, int) for x in layers)):
        raise ValueError(f"adapter_config.json: layers_to_transform must be an integer or a list of them, got {layers!r}")

    modules = _module_names(cfg)

    layers_pattern = config.get("layers_pattern") or []
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]

    def layer_index(name: str) -> Optional[int]:
        """The layer PEFT reads from a module name: the first numbered segment (after one of
        layers_pattern when given)."""
        pats = [rf"(?:^|.*?\.){re.escape(p)}\.(?P<idx>\d+)\." for p in layers_pattern] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
        for pat in pats:
            m = re.match(pat, name)
            if m:
                return int(m.group("idx"))
        return None

    def targeted(name: str, kind: str) -> bool:
        """PEFT's check_target_module_exists: excluded modules first; a regex (full match) ignores
        layers_to_transform; a list matches names or dotted suffixes, the suffix ones limited to
        layers_to_transform."""
        if excluded and _match_target(name, excluded):
            return False
        if targets is None:  # all-linear: every linear layer but the output layer
            return kind not in ("embedding targets", "lm_head targets")
        if isinstance(targets, str):
            return re.fullmatch(targets, name) is not None
        if name in targets:
            return True
        if not any(name.endswith("." + t) for t in targets):
            return False
        return not layers or layer_index(name) in layers

    dtypes: Dict[str, str] = {}
    tensors = read_safetensors(weights, dtypes)
    found: Dict[str, Dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
                         r"lora_magnitude_vector)(\.weight|\.bias)?", key)
        if m is None:
            raise ValueError(f"{weights.name}: unexpected tensor {key!r} (not a LoRA A/B weight)")
        module, part, suffix = m.groups()
        if part == "lora_magnitude_vector":
            raise ValueError(f"{weights.name}: tensor {key!r} is DoRA's magnitude; DoRA is not supported")
        if part.startswith("lora_embedding") or modules.get(module, ("",))[0] == "embedding targets":
            raise ValueError(f"{weights.name}: tensor {key!r}: embedding targets are not supported")
        if suffix == ".bias":
            raise ValueError(f"{weights.name}: tensor {key!r}: lora_bias is not supported")
        if suffix is None:
            raise ValueError(f"{weights.name}: unexpected tensor {key!r} (not a LoRA A/B weight)")
        if module not in modules:
            raise ValueError(f"{weights.name}: tensor {key!r} names module {module!r}, which the base model "
                             f"does not have")
        kind = modules[module][0]
        if kind != "ok":
            raise ValueError(f"{weights.name}: tensor {key!r}: {kind} are not supported")
        found.setdefault(module, {})[part] = value

    pairs = []
    for name, (kind, _, _) in modules.items():
        hit = targeted(name, kind)
        if not hit:
            if name in found:
                raise ValueError(f"{weights.name}: extra tensors for {name!r}, which adapter_config.json does not "
                                 f"target")
            continue
        if kind != "ok":
            if targets is None:
                continue  # all-linear: these are not linear layers PEFT would have saved for this model
            raise ValueError(f"adapter_config.json: target_modules selects {name!r}: {kind} are not supported")
        pair = found.get(name, {})
        for part in ("lora_A", "lora_B"):
            if part not in pair:
                raise ValueError(f"{weights.name}: missing tensor base_model.model.{name}.{part}.weight")
        rank = _pattern_value(patterns["rank_pattern"], name, r)
        a_alpha = _pattern_value(patterns["alpha_pattern"], name, alpha)
        a_name, b_name = f"base_model.model.{name}.lora_A.weight", f"base_model.model.{name}.lora_B.weight"
        pairs.append(_Pair(name, name, a_name, pair["lora_A"], b_name, pair["lora_B"], rank,
                           a_alpha / math.sqrt(rank) if rslora else a_alpha / rank, dtypes[a_name], dtypes[b_name]))
    updates = _updates(pairs, cfg, max_rank, weights.name, interleaved=False, storage=storage)
    if not updates:
        raise ValueError(f"{path}: the adapter updates none of the model's projections (target_modules "
                         f"{config.get('target_modules')!r})")
    return updates


# ---- llama.cpp's GGUF adapters (convert_lora_to_gguf.py; read as src/llama-adapter.cpp reads them) ----
# The architecture llama.cpp's converter names a base of each ferrum architecture (Mistral's is llama).
_LLAMA_CPP_ARCH = {"mistral": "llama", "qwen3_moe": "qwen3moe"}
# The architectures whose q/k rows (and adapters' B rows) the converter interleaves, as ferrum reads
# a GGUF base of them.
_GGUF_INTERLEAVED = ("llama", "mistral")
_GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                     "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}
_GGUF_REFUSED = {"token_embd": "embedding targets", "output": "lm_head targets", "ffn_gate_inp": "router targets",
                 "ffn_gate_exps": "expert targets", "ffn_up_exps": "expert targets", "ffn_down_exps": "expert targets"}
# What the converter writes (--outtype; q8_0 leaves rows that are not whole blocks in f16).
_GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")


def read_gguf_adapter(path, cfg: dict, max_rank: int, storage: Optional[str] = None) -> List[tuple]:
    """A llama.cpp GGUF LoRA adapter as the runner's updates for a model of config `cfg` (A and B
    kept in `storage`, None: the file's type, which its f32 values re-encode exactly), applied as
    llama.cpp applies it: every lora_a / lora_b pair, scaled by adapter.lora.alpha / rank
    (1 when the file has no alpha or alpha 0). ValueError, naming the field or tensor, for a file
    that is not a LoRA adapter of this base or that ferrum would not apply exactly."""
    from . import _core
    path = Path(path)
    meta, tensors = _core.gguf_read(str(path))
    src = path.name
    if meta.get("general.type") != "adapter":
        raise ValueError(f"{src}: general.type is {meta.get('general.type')!r}, not 'adapter' (a model, not an "
                         f"adapter?)")
    if meta.get("adapter.type") != "lora":
        raise ValueError(f"{src}: adapter.type {meta.get('adapter.type')!r} is not supported (only 'lora')")
    arch = meta.get("general.architecture")
    if arch not in (cfg["arch"], _LLAMA_CPP_ARCH.get(cfg["arch"], cfg["arch"])):
        raise ValueError(f"{src}: general.architecture is {arch!r}, but the base model is {cfg['arch']!r}")
    if "adapter.alora.invocation_tokens" in meta:
        raise ValueError(f"{src}: aLoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = _number(meta, "adapter.lora.alpha", zero=True, source=src) if "adapter.lora.alpha" in meta else 0

    modules = _module_names(cfg)
    found: Dict[str, Dict[str, np.ndarray]] = {}
    for key, (dtype, value) in tensors.items():
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.weight\.lora_(a|b)", key)
        if m is None:
            raise ValueError(f"{src}: unexpected tensor {key!r} (not a LoRA lora_a / lora_b weight)")
        layer, name, part = m.groups()
        if name in _GGUF_REFUSED:
            raise ValueError(f"{src}: tensor {key!r}: {_GGUF_REFUSED[name]} are not supported")
        module = f"model.layers.{layer}.{_GGUF_PROJECTIONS[name]}" if layer and name in _GGUF_PROJECTIONS else None
        if module not in modules:
            raise ValueError(f"{src}: tensor {key!r} names a weight the base model does not have")
        if modules[module][0] != "ok":
            raise ValueError(f"{src}: tensor {key!r}: {modules[module][0]} are not supported")
        if dtype not in _GGUF_DTYPES:
            raise ValueError(f"{src}: tensor {key!r} has type {dtype}; adapters are read in "
                             f"{', '.join(_GGUF_DTYPES)}")
        found.setdefault(key[:-len(".lora_a")], {})[part] = value
        found[key[:-len(".lora_a")]][part + "_dtype"] = dtype

    pairs = []
    for weight, pair in found.items():
        for part in ("a", "b"):
            if part not in pair:
                raise ValueError(f"{src}: missing tensor {weight}.lora_{part} (the pair of {weight}.lora_"
                                 f"{'b' if part == 'a' else 'a'})")
        layer, name = weight.split(".")[1:3]
        rank = pair["b"].shape[-1]  # llama.cpp's: lora_b's columns
        pairs.append(_Pair(f"model.layers.{layer}.{_GGUF_PROJECTIONS[name]}", weight, f"{weight}.lora_a", pair["a"],
                           f"{weight}.lora_b", pair["b"], rank, alpha / rank if alpha else 1.0,
                           pair["a_dtype"], pair["b_dtype"]))
    if not pairs:
        raise ValueError(f"{src}: the adapter has no lora_a / lora_b tensors")
    return _updates(pairs, cfg, max_rank, src, interleaved=arch in _GGUF_INTERLEAVED, storage=storage)


def read_adapter(path, cfg: dict, max_rank: int, lora_dtype: str = "auto") -> List[tuple]:
    """A PEFT directory or a llama.cpp .gguf file as the runner's updates, A and B kept as
    `lora_dtype` says (LORA_DTYPES)."""
    storage = lora_storage(lora_dtype)
    if Path(path).suffix == GGUF_SUFFIX and not Path(path).is_dir():
        return read_gguf_adapter(path, cfg, max_rank, storage)
    return read_peft_adapter(path, cfg, max_rank, storage)


def cache_key(updates: List[tuple]) -> int:
    """A 64-bit hash of the updates' content, storage dtypes and scales: what keys their
    prefix-cache blocks (with each request's scale)."""
    h = hashlib.sha256()
    for site, a, b, col, scale in updates:
        h.update(struct.pack("<qqqqd", site, col, a.shape[0], b.shape[0], scale))
        for m in (a, b):
            h.update(m.dtype.encode() + b"\0")
            h.update(m.data.tobytes())
    return int.from_bytes(h.digest()[:8], "little")


class LoraCache:
    """The adapters loaded for one runner, by lora_int_id, least recently used first; at most
    `capacity` stay (requests that run with an evicted or removed adapter keep it until they end)."""

    def __init__(self, runner, capacity: int, lora_dtype: str = "auto"):
        self.runner = runner
        self.capacity = capacity
        self.lora_dtype = lora_dtype
        lora_storage(lora_dtype)
        self._loaded: "OrderedDict[int, Tuple[LoRARequest, object]]" = OrderedDict()

    def get(self, request: LoRARequest):
        """The runner's adapter for `request`, loaded now if it is not in the cache."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a ferrum.LoRARequest, got {type(request).__name__}")
        entry = self._loaded.get(request.lora_int_id)
        if entry is not None and entry[0].path == request.path:
            self._loaded.move_to_end(request.lora_int_id)
            return entry[1]
        updates = read_adapter(request.path, self.runner.config, self.runner.max_lora_rank, self.lora_dtype)
        adapter = self.runner.make_lora(updates, cache_key(updates))
        self._loaded[request.lora_int_id] = (request, adapter)
        self._loaded.move_to_end(request.lora_int_id)
        while len(self._loaded) > self.capacity:
            self._loaded.popitem(last=False)
        return adapter

    def remove(self, lora_id: int) -> bool:
        return self._loaded.pop(lora_id, None) is not None

    def ids(self) -> List[int]:
        return list(self._loaded)

    def requests(self) -> List[LoRARequest]:
        return [req for req, _ in self._loaded.values()]
