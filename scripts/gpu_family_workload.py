"""A small run of every kernel of the OpenCL gpu family, on whatever OpenCL device the environment
gives (pocl, or Oclgrind's simulator for tests/test_opencl_oclgrind.py): every weight type's
matmuls (a decode, a batched decode, a prompt; GGUF rows and flat repacked rows) and embedding
rows, the quantized checkpoints' input gather and group offsets, then two small generated models (dense with mixed k-quants, Qwen3-MoE in Q8_0) under each
KV dtype: two prompts in one step, a batched decode of both, one decode alone. The tuning comes
from FERRUM_OPENCL_GPU_TUNING as the backend reads it.

usage: python scripts/gpu_family_workload.py OUT_DIR
       writes OUT_DIR/outputs.npz (every result) and OUT_DIR/programs.json (the programs built)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

WEIGHT_DTYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
                 "q6_k", "iq4_nl", "iq4_xs")
MODELS = (("llama", "q4_k_m"), ("qwen3_moe", "q8_0"))
KV_DTYPES = ("f32", "f16", "int8")
ROWS, K = 32, 256


def weight(be, dtype: str, w: np.ndarray):
    from ferrum import _core
    if dtype == "f32":
        return be.tensor(w)
    if dtype == "f16":
        return be.tensor(w.astype(np.float16))
    return be.tensor_raw(np.concatenate([_core.quant.quantize(dtype, row) for row in w]), dtype, list(w.shape))


def matmuls(be, out: dict) -> None:
    rng = np.random.default_rng(0)
    for dtype in WEIGHT_DTYPES:
        w = rng.standard_normal((ROWS, K)).astype(np.float32)
        xs = {T: rng.standard_normal((T, K)).astype(np.float32) for T in (1, 3, 40)}
        for layout in ("gguf", "flat"):
            t = weight(be, dtype, w)
            if layout == "flat":
                t = be.pack_weight(t)
            for T, x in xs.items():
                y = be.empty("f32", [T, ROWS])
                be.linear(be.tensor(x), t, None, y)
                out[f"linear/{dtype}/{layout}/T{T}"] = y.numpy()
            e = be.empty("f32", [2, K])
            be.embedding(be.tensor(np.array([0, ROWS - 1], np.int32)), t, e)
            out[f"embedding/{dtype}/{layout}"] = e.numpy()


def quantized_checkpoint_ops(be, out: dict) -> None:
    """What GPTQ / compressed-tensors projections add around their matmul: act-order's gather of
    the inputs and asymmetric 8-bit zeros' group offsets (blocks in groups out of order), on a
    dense projection and on experts (each expert's inputs in its own order)."""
    rng = np.random.default_rng(1)
    for T in (1, 3):
        x = rng.standard_normal((T, K)).astype(np.float32)
        order = rng.permutation(K).astype(np.int32)
        g = be.empty("f32", [T, K])
        be.gather_columns(be.tensor(x), be.tensor(order), g)
        out[f"gather_columns/T{T}"] = g.numpy()
        block_groups = rng.permutation(np.arange(K // 32) % 3).astype(np.int32)
        y = be.tensor(rng.standard_normal((T, ROWS + 2)).astype(np.float32))
        be.add_group_offsets(be.tensor(x), be.tensor(block_groups),
                             be.tensor(rng.standard_normal((3, ROWS)).astype(np.float32)), y)
        out[f"add_group_offsets/T{T}"] = y.numpy()
        # The same on mixture-of-experts products, with act-order's orders: 2 experts, each token
        # picks both.
        E, I, H = 2, 32, 64
        ws = [be.tensor((rng.standard_normal(shape) / 8).astype(np.float32)) for shape in ((E, I, H), (E, I, H), (E, H, I))]
        offsets = {name: (be.tensor(rng.standard_normal((E, 2, n)).astype(np.float32)),
                          be.tensor(rng.integers(0, 2, k // 32).astype(np.int32)))
                   for name, n, k in (("gate", I, H), ("up", I, H), ("down", H, I))}
        moe = be.empty("f32", [T, H])
        be.moe_experts(be.tensor(x[:, :H].copy()), *ws, be.tensor(np.tile(np.arange(E, dtype=np.int32), (T, 1))),
                       be.tensor(np.full((T, E), 0.5, np.float32)), moe, offsets=offsets,
                       input_orders={"gate_up": be.tensor(np.stack([rng.permutation(H) for _ in range(E)]).astype(np.int32)),
                                     "down": be.tensor(np.stack([rng.permutation(I) for _ in range(E)]).astype(np.int32))})
        out[f"moe_group_offsets/T{T}"] = moe.numpy()


def model_steps(path: Path, device: str, kv: str) -> list[np.ndarray]:
    """Logits of two prompts sharing a step, a batched decode of both, one decode alone."""
    from ferrum import _core
    r = _core.ModelRunner(str(path), device=device, num_threads=1, kv_dtype=kv, max_model_len=64,
                          kv_cache_tokens=64)
    a, b = r.add_sequence(), r.add_sequence()
    steps = [r.step([(a, list(range(1, 20)), "all"), (b, list(range(30, 42)), "all")]),
             r.step([(a, [7], "last"), (b, [9], "last")]),
             r.step([(a, [11], "last")])]
    return [np.asarray(s) for s in steps]


def model_files(directory: Path) -> list[Path]:
    from ferrum.tools.make_model import make_model
    directory.mkdir(parents=True, exist_ok=True)
    return [make_model(arch, "tiny", "gguf", dtype, seed=0, out=directory / f"{arch}-{dtype}.gguf", vocab_size=256)
            for arch, dtype in MODELS]


def run(out_dir: Path, models: list[Path]) -> None:
    from ferrum import _core
    os.environ["FERRUM_OPENCL_KERNELS"] = "gpu"
    out: dict = {}
    be = _core.make_backend("opencl", opencl_kernels="gpu")
    matmuls(be, out)
    quantized_checkpoint_ops(be, out)
    for path in models:
        for kv in KV_DTYPES:
            for i, logits in enumerate(model_steps(path, "opencl", kv)):
                out[f"model/{path.stem}/{kv}/step{i}"] = logits
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(out_dir / "outputs.npz", **out)
    programs = [[list(s), o] for s, o in _core.opencl.programs_requested()]
    (out_dir / "programs.json").write_text(json.dumps(programs))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    run(out, model_files(out / "models"))
