"""The CPU backend's AVX-512 copies of its own loops (paged attention, RMS norm, RoPE, SwiGLU:
cpp/backend/cpu/attention_kernel.h, row_kernels.h) compute the bits of their baseline copies, so
FERRUM_CPU_ISA=avx2 changes none of these ops' outputs (docs/install.md). Each side runs in a
process of its own, the dispatch capped or not."""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def attention_outputs(be, rng, out, name, H, KV, hd, kv_dtype, block_size, lens):
    """qkv_to_cache (QK-norm, RoPE) then paged_attention: a prefill of every sequence, then one
    more token each; out[name + ...] = the queries and attention outputs of both steps."""
    import reference as R
    from ferrum import _core
    S, max_len = len(lens), max(lens) + 1
    max_blocks = (max_len + block_size - 1) // block_size
    tables = rng.permutation(S * max_blocks + 2)[:S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    shape = [S * max_blocks + 2, KV, block_size, hd]
    scales = [be.empty("f32", shape[:3]), be.empty("f32", shape[:3])] if kv_dtype == "i8" else []
    kv = _core.KvLayer(be.empty(kv_dtype, shape), be.empty(kv_dtype, shape), *scales)
    cos, sin = R.rope_tables(256, hd, 1e4)
    rope = _core.RopeTable(be.tensor(cos.astype(np.float32)), be.tensor(sin.astype(np.float32)),
                           _core.RopeLayout.half_split)
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), 0)
    qn, kn = (be.tensor(rng.standard_normal(hd).astype(np.float32)) for _ in range(2))
    for step, rows in enumerate([[(s, 0, n) for s, n in enumerate(lens)], [(s, n, 1) for s, n in enumerate(lens)]]):
        seq = np.concatenate([np.full(c, s) for s, f, c in rows]).astype(np.int32)
        pos = np.concatenate([np.arange(f, f + c) for s, f, c in rows]).astype(np.int32)
        slots = (tables[seq, pos // block_size] * block_size + pos % block_size).astype(np.int32)
        batch = _core.AttnBatch(be.tensor(seq), be.tensor(pos), be.tensor(slots), be.tensor(tables))
        qkv = rng.standard_normal((len(seq), (H + 2 * KV) * hd)).astype(np.float32)
        q, o = be.empty("f32", [len(seq), H, hd]), be.empty("f32", [len(seq), H, hd])
        be.qkv_to_cache(be.tensor(qkv), qn, kn, 1e-6, rope, batch, params, q, kv)
        be.paged_attention(q, kv, batch, params, o)
        out[f"{name}_q{step}"], out[f"{name}_out{step}"] = q.numpy(), o.numpy()


def compute(path):
    """Every op's outputs on fixed inputs, saved to path (the process's own dispatch)."""
    sys.path.insert(0, HERE)
    from ferrum import _core
    be, rng, out = _core.make_backend("cpu", 2), np.random.default_rng(5), {}
    for H, KV, hd in [(4, 2, 64), (6, 2, 128), (2, 1, 80)]:
        for kv_dtype in ["f16", "f32", "i8"]:
            for block_size in [16, 12]:
                attention_outputs(be, rng, out, f"attn_{H}_{KV}_{hd}_{kv_dtype}_{block_size}", H, KV, hd, kv_dtype,
                                  block_size, [37, 5, 70])
    x = rng.standard_normal((7, 576)).astype(np.float32) * 3
    w = rng.standard_normal(576).astype(np.float32)
    norm = be.empty("f32", [7, 576])
    be.rms_norm(be.tensor(x), be.tensor(w), 1e-5, norm)
    gate_up = rng.standard_normal((5, 2 * 1000)).astype(np.float32) * 4
    act = be.empty("f32", [5, 1000])
    be.swiglu(be.tensor(gate_up), act)
    out["rms_norm"], out["swiglu"] = norm.numpy(), act.numpy()
    np.savez(path, **out)


def run(tmp_path, isa):
    path = str(tmp_path / f"{isa}.npz")
    proc = subprocess.run([sys.executable, __file__, path], env=dict(os.environ, FERRUM_CPU_ISA=isa),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.load(path)


def test_avx512_copies_compute_the_baseline_copies_bits(tmp_path):
    features = subprocess.run([sys.executable, "-c", "from ferrum import _core; print(_core.cpu_features())"],
                              env=dict(os.environ, FERRUM_CPU_ISA="avx512"), capture_output=True, text=True)
    if "avx512f" not in features.stdout.split():
        pytest.skip("no AVX-512 here: only the baseline copies run")
    wide, baseline = run(tmp_path, "avx512"), run(tmp_path, "avx2")
    assert sorted(wide.files) == sorted(baseline.files) and len(wide.files) == 2 + 3 * 3 * 2 * 4
    for name in wide.files:
        np.testing.assert_array_equal(wide[name], baseline[name], err_msg=name)


if __name__ == "__main__":
    compute(sys.argv[1])
