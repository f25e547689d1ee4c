"""LoRA adapters per request, as vLLM serves them: ``LoRARequest`` names an adapter (a PEFT
directory: ``adapter_config.json`` + ``adapter_model.safetensors``); the model loads it on first
use and keeps it in a host-memory LRU (``max_cpu_loras``).

PEFT's per-module updates map onto the decoder's projections: q/k/v fill their columns of the
fused qkv output, gate/up theirs of gate_up; o and down as they are. What ferrum does not apply
(DoRA, ``modules_to_save``, ``lora_bias``, embedding / lm_head / router / expert targets) is
refused when the adapter loads, never silently skipped.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"

# Decoder projection sites (cpp/model/lora.h): layer * SITES_PER_LAYER + site.
SITES_PER_LAYER = 4
SITE_QKV, SITE_O, SITE_GATE_UP, SITE_DOWN = range(4)

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's ``LoRARequest``): ``lora_name`` (what the server lists),
    ``lora_int_id`` (>= 1, the cache's key: one id is one adapter), ``lora_path`` (a PEFT adapter
    directory)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path must name an adapter directory, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return str(self.lora_path)


# ---- safetensors, read with numpy (the format: u64 header size, JSON header, raw data) ----
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path: Path) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32. ValueError for a damaged file or a dtype
    other than f64 / f32 / f16 / bf16."""
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


def _number(config: dict, field: str, kind=float, positive=True):
    v = config.get(field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
            or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"adapter_config.json: {field} must be a positive {'integer' if kind is int else 'number'}, "
                         f"got {v!r}")
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


def _interleave_rows(b: np.ndarray, heads: int) -> np.ndarray:
    """B's output rows in the order of a base whose q/k rows llama.cpp's converter permuted (RoPE
    pairs interleaved): each head's halves [0, d/2) and [d/2, d) become pairs (i, d/2 + i)."""
    n, r = b.shape
    return b.reshape(heads, 2, n // heads // 2, r).swapaxes(1, 2).reshape(n, r)


_REFUSED_FLAGS = (("use_dora", "DoRA (use_dora)"), ("lora_bias", "lora_bias"),
                  ("modules_to_save", "modules_to_save"), ("layer_replication", "layer_replication"),
                  ("target_parameters", "target_parameters"), ("trainable_token_indices", "trainable_token_indices"),
                  ("alora_invocation_tokens", "aLoRA (alora_invocation_tokens)"), ("use_qalora", "QALoRA"))


def read_peft_adapter(path, cfg: dict, max_rank: int) -> List[tuple]:
    """A PEFT LoRA directory as the runner's updates [(site, A, B, out_col, scale)] for a model of
    config `cfg` (ModelRunner.config). ValueError, naming the field or tensor, for anything ferrum
    would not apply exactly as PEFT does."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        raise ValueError(f"{path}: GGUF LoRA adapters are not supported yet; give the PEFT adapter directory")
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

    tensors = read_safetensors(weights)
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

    updates = []
    cfg_rows = cfg.get("rope_layout") == "interleaved"
    for name, (kind, layer, proj) in modules.items():
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
        a, b = pair["lora_A"], pair["lora_B"]
        site, col, out_f, in_f = _projection(cfg, proj)
        if rank > max_rank:
            raise ValueError(f"{name}: rank {rank} is more than max_lora_rank {max_rank}")
        if a.shape != (rank, in_f):
            raise ValueError(f"{weights.name}: tensor base_model.model.{name}.lora_A.weight is {list(a.shape)}, "
                             f"the base model needs [{rank}, {in_f}]")
        if b.shape != (out_f, rank):
            raise ValueError(f"{weights.name}: tensor base_model.model.{name}.lora_B.weight is {list(b.shape)}, "
                             f"the base model needs [{out_f}, {rank}]")
        for part, t in (("lora_A", a), ("lora_B", b)):
            if not np.isfinite(t).all():
                raise ValueError(f"{weights.name}: tensor base_model.model.{name}.{part}.weight has non-finite values")
        if cfg_rows and proj in ("q_proj", "k_proj"):
            b = _interleave_rows(b, cfg["num_heads"] if proj == "q_proj" else cfg["num_kv_heads"])
        scale = a_alpha / math.sqrt(rank) if rslora else a_alpha / rank
        updates.append((layer * SITES_PER_LAYER + site, np.ascontiguousarray(a), np.ascontiguousarray(b), col,
                        float(scale)))
    if not updates:
        raise ValueError(f"{path}: the adapter updates none of the model's projections (target_modules "
                         f"{config.get('target_modules')!r})")
    return updates


def cache_key(updates: List[tuple]) -> int:
    """A 64-bit hash of the updates' content and scales: what keys their prefix-cache blocks."""
    h = hashlib.sha256()
    for site, a, b, col, scale in updates:
        h.update(struct.pack("<qqqqd", site, col, a.shape[0], b.shape[0], scale))
        h.update(a.tobytes())
        h.update(b.tobytes())
    return int.from_bytes(h.digest()[:8], "little")


class LoraCache:
    """The adapters loaded for one runner, by lora_int_id, least recently used first; at most
    `capacity` stay (requests that run with an evicted or removed adapter keep it until they end)."""

    def __init__(self, runner, capacity: int):
        self.runner = runner
        self.capacity = capacity
        self._loaded: "OrderedDict[int, Tuple[LoRARequest, object]]" = OrderedDict()

    def get(self, request: LoRARequest):
        """The runner's adapter for `request`, loaded now if it is not in the cache."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a ferrum.LoRARequest, got {type(request).__name__}")
        entry = self._loaded.get(request.lora_int_id)
        if entry is not None and entry[0].path == request.path:
            self._loaded.move_to_end(request.lora_int_id)
            return entry[1]
        updates = read_peft_adapter(request.path, self.runner.config, self.runner.max_lora_rank)
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
