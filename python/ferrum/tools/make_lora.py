"""Random-weight LoRA adapters for generated models, made by PEFT itself:

    python -m ferrum.tools.make_lora --model /tmp/llama-tiny --r 8 --alpha 16 --seed 1 --out /tmp/lora

The base is an HF directory (make_model --format hf); PEFT's get_peft_model wraps it with the
config asked for, A and B are drawn from a seeded generator (B non-zero, unlike a fresh PEFT
adapter, so the adapter changes the outputs), and save_pretrained writes adapter_config.json +
adapter_model.safetensors, A and B in --dtype (float32, float16 or bfloat16). Needs torch, transformers and peft (the test extra).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(model: Union[str, Path], out: Union[str, Path], r: int = 8, lora_alpha: float = 16,
              target_modules: Union[str, Sequence[str]] = DEFAULT_TARGETS, use_rslora: bool = False,
              rank_pattern: Optional[dict] = None, alpha_pattern: Optional[dict] = None,
              layers_to_transform: Optional[Sequence[int]] = None, seed: int = 0, b_std: float = 0.05,
              zero_b: bool = False, peft_model=None, dtype: str = "float32") -> Path:
    """Writes a PEFT LoRA adapter for the HF model directory `model` into `out`; returns `out`.
    zero_b: keep B at zero (PEFT's own initialisation: the adapter changes nothing). dtype: what A
    and B are saved in ("float32", "float16", "bfloat16"); the model given to peft_model keeps
    them in f32, holding the saved values.
    peft_model: a list to append the PEFT-wrapped model to (tests use it as their oracle)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=(
        target_modules if isinstance(target_modules, str) else list(target_modules)),
        use_rslora=use_rslora, rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=list(layers_to_transform) if layers_to_transform is not None else None,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    saved = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if saved is None:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    wrapped = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.zeros(p.shape) if zero_b else torch.randn(p.shape, generator=gen) * b_std)
    lora = [p for name, p in wrapped.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    for p in lora:
        p.data = p.data.to(saved)
    out = Path(out)
    wrapped.save_pretrained(str(out), safe_serialization=True)
    for p in lora:  # the saved values, exactly, in f32
        p.data = p.data.float()
    if peft_model is not None:
        peft_model.append(wrapped)
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (make_model --format hf)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help="comma-separated module names, or 'all-linear'")
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--rank-pattern", default=None, help='JSON, e.g. {"q_proj": 4}')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero-b", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    a = ap.parse_args(argv)
    targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
    make_lora(a.model, a.out, a.r, a.alpha, targets, a.rslora,
              json.loads(a.rank_pattern) if a.rank_pattern else None, seed=a.seed, zero_b=a.zero_b,
              dtype=a.dtype)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
