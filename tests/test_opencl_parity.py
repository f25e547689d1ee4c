"""CPU vs OpenCL on every op and every weight dtype, the same inputs on both backends (the idea of
llama.cpp's test-backend-ops), for both of the OpenCL backend's kernel families: `ocl` is the cpu
family (pocl's) and the gpu family (GPUs'), each run here on pocl.

Bounds (normalised mean squared error, NMSE = |a - b|^2 / |b|^2):
- f32 paths: 1e-7. Both backends compute in f32 and differ only in summation order.
- linear over quantized weights with few rows (T <= 8): the CPU backend quantizes activations
  to 8 bits per 32- or 256-element block first (as llama.cpp does). OpenCL does so for decodes
  (one token, or a batch of decodes) over the types with integer dot kernels, always per 32
  elements as the CPU's Q8_0 (the same quants and scales), and keeps f32 activations otherwise.
  Where only one side quantizes, or the CPU uses Q8_K (the k-quants, IQ4_XS), the difference is the
  activation rounding error: NMSE against the exact product about 3e-5 for Gaussian activations
  (the Q8_0 / Q8_K round-trip error, measured 3.2e-5 / 5.8e-5; CPU vs OpenCL measured 2e-5 ..
  1.1e-4). Bound 3e-4. Where both quantize to Q8_0 they differ only in summation order (measured
  1e-14 .. 2e-13, either family): F32_BOUND. OpenCL itself is held to f32 accuracy (1e-10) against a float64
  product of the dequantized weights with the activations it sees (x, or x's Q8_0 round trip).
- linear over bf16 weights with many rows (T > 8, AVX512_BF16 CPUs): the CPU's bf16 GEMM rounds
  activations to bf16 (relative error up to 2^-8); its NMSE against the exact product is about
  2.7e-6 for Gaussian activations (measured 2.2e-6 .. 3.2e-6 over 3 seeds, T = 9 / 33 / 128).
  Bound 1e-5.
- f16 KV cache: both round each stored K/V element to the nearest f16; an element can differ
  by one f16 ulp (2^-11 relative) when the f32 values before rounding differ in their last
  bit (after QK-norm / RoPE in a different order). One such element among the ~6000 compared
  gives NMSE ~ (2^-11)^2 / 6000 = 4e-11 (measured 4e-11): bound 1e-8.
- int8 KV cache: a row's scale is amax / 127 on both, but a rounding tie can move one element by
  one step (1/127 of the row's max): ~ (1/127)^2 / 6000 = 1e-8 per such element: bound 1e-6.
- moe_experts: f32 / f16 / bf16 experts: 1e-7. Quantized experts: the CPU runs an expert chosen
  by few tokens (and every expert in a batch of decodes) on its dot kernels, which quantize the
  activations to 8 bits twice (x for gate / up, then the SwiGLU output for down); OpenCL does the
  same on its row-dot path (a decode or a short prompt) with Q8_0 for every type, and keeps f32
  activations on its grouped tiles (a longer prompt). Where only the CPU quantizes, CPU vs OpenCL
  is the CPU's own error (measured equal to its NMSE against float64 to two digits): with Q8_0
  (the 32-element types) under linear's 3e-4 (measured 1e-4 .. 1.5e-4), with Q8_K (the k-quants)
  up to 4.3e-4 (3 seeds, T = 1 / 3 / 33). Where both quantize, the 32-element types measure
  1e-14 .. 7e-14 (the same quants: 3e-4 still allows the SwiGLU output of one backend to round
  one element differently), the k-quants up to 6.4e-4 (Q8_K against Q8_0, 4 seeds). So the
  k-quants are held to 1e-3, the bound tests/test_moe_ops.py puts on the CPU's quantized
  experts against float64, the rest to 3e-4. OpenCL itself is held to f32 accuracy (1e-10)
  against a float64 reference over the dequantized experts where it keeps f32 activations,
  and to 1e-3 where it quantizes them (measured up to 1.9e-4).
- moe_route: the same expert ids on both (exact), weights within 1e-7.
Dequantization (embedding rows) is bit-exact on both backends and both families.
The two families compute the same things (8-bit activations exactly where the other does, the same
dequantized values) in different orders (a lane tree per row, tiles in local memory), so every
bound above holds for both; the bit-for-bit properties (a decode alone or in a batch, embedding
rows) hold for each.
"""
import numpy as np
import pytest

import reference as R
from ferrum import _core
from test_ops import linear_on_stream, rope_query_heads

WEIGHT_DTYPES = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k",
                 "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
FLOAT_DTYPES = ("f32", "f16", "bf16")
F32_BOUND = 1e-7
Q8_ACT_BOUND = 3e-4
BF16_ACT_BOUND = 1e-5  # the CPU's bf16 GEMM (prefill) rounds activations to bf16
MOE_Q8K_ACT_BOUND = 1e-3  # moe_experts with k-quant experts (Q8_K activations, rounded twice)
MOE_Q8_ACT_VS_EXACT_BOUND = 1e-3  # OpenCL moe_experts over 8-bit activations vs float64
CPU_DOT_MAX_TOKENS = 8  # cpp/backend/cpu/cpu_linear.cpp: kMaxDotTokens
# OpenCL decodes over these quantize activations to Q8_0 (cl_ops_linear.cpp: dot_q8).
OPENCL_Q8_DTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
KERNEL_FAMILIES = ("cpu", "gpu")


def cpu_uses_q8k(dtype):
    """The CPU backend's dot kernels quantize activations to Q8_K (256 elements) for these."""
    return dtype.endswith("_k") or dtype == "iq4_xs"


@pytest.fixture(scope="module")
def cpu():
    return _core.make_backend("cpu", 2)


@pytest.fixture(scope="module", params=KERNEL_FAMILIES)
def ocl(request):
    return _core.make_backend("opencl", opencl_kernels=request.param)


def encode_weight(w, dtype):
    """(bytes or array to upload, the float64 values the backends see) for weights w [n, k]."""
    if dtype == "f32":
        return w, w.astype(np.float64)
    if dtype == "f16":
        h = w.astype(np.float16)
        return h, h.astype(np.float64)
    raw = np.concatenate([_core.quant.quantize(dtype, row) for row in w])
    deq = np.stack([_core.quant.dequantize(dtype, _core.quant.quantize(dtype, row), w.shape[1]) for row in w])
    return raw, deq.astype(np.float64)


def q8_0_round_trip(x):
    """x [T, K] as the backends' 8-bit activations see it: each row through the Q8_0 quantizer
    (the CPU's, which OpenCL's quantize_q8_rows matches) and back."""
    return np.stack([_core.quant.dequantize("q8_0", _core.quant.quantize("q8_0", r), x.shape[1]) for r in x])


def opencl_decode_x(x, dtype):
    """The activations OpenCL's one-token linear dots with weights of dtype."""
    return q8_0_round_trip(x) if dtype in OPENCL_Q8_DTYPES else x


def cpu_vs_opencl_bound(dtype, opencl_q8):
    """CPU vs OpenCL bound for a few-row linear (T <= 8) the CPU runs on its dot kernels."""
    if dtype in FLOAT_DTYPES:
        return F32_BOUND
    same_activations = opencl_q8 and not cpu_uses_q8k(dtype)  # both Q8_0
    return F32_BOUND if same_activations else Q8_ACT_BOUND


def upload_weight(be, raw, dtype, shape):
    if dtype in ("f32", "f16"):
        return be.tensor(raw)
    return be.tensor_raw(raw, dtype, list(shape))


def test_supports_is_truthful(cpu, ocl):
    all_types = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k",
                 "q4_k", "q5_k", "q6_k", "q8_k", "iq4_nl", "iq4_xs"]
    for dt in all_types:
        for op in ("linear", "embedding"):
            assert ocl.supports(op, dt) == (dt in WEIGHT_DTYPES), (op, dt)
    for dt in all_types:
        if dt in WEIGHT_DTYPES:
            continue
        w = ocl.tensor_raw(np.zeros(len(_core.quant.quantize(dt, np.zeros(256, np.float32))), np.uint8), dt, [1, 256])
        with pytest.raises(ValueError, match="no kernels"):
            ocl.linear(ocl.tensor(np.zeros((1, 256), np.float32)), w, None, ocl.empty("f32", [1, 1]))
    for op in ("rms_norm", "add_rms_norm", "qkv_to_cache", "paged_attention", "swiglu", "gather_rows", "lora",
               "gather_columns", "add_group_offsets"):
        assert ocl.supports(op)
    assert ocl.supports("moe_route")
    for dt in all_types:
        assert ocl.supports("moe_experts", dt) == (dt in WEIGHT_DTYPES), dt


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 9, 33])
def test_linear_parity(cpu, ocl, rng, dtype, tokens):
    K, N, out_col, width = 512, 37, 5, 45  # N not a multiple of the 4-row tile
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    raw, wref = encode_weight(w, dtype)
    sentinel = np.full((tokens, width), 7.0, np.float32)
    outs = {}
    for name, be in (("cpu", cpu), ("opencl", ocl)):
        out = be.tensor(sentinel)
        be.linear(be.tensor(x), upload_weight(be, raw, dtype, (N, K)), be.tensor(bias), out, out_col=out_col)
        outs[name] = out.numpy()
    for got in outs.values():  # columns outside [out_col, out_col + N) untouched
        assert (got[:, :out_col] == 7.0).all() and (got[:, out_col + N:] == 7.0).all()
    x_seen = opencl_decode_x(x, dtype) if tokens == 1 else x  # a prompt (no decode_rows): f32
    ref = x_seen.astype(np.float64) @ wref.T + bias
    o, c = outs["opencl"][:, out_col:out_col + N], outs["cpu"][:, out_col:out_col + N]
    assert R.nmse(o, ref) < 1e-10
    cpu_gemm = tokens > CPU_DOT_MAX_TOKENS and _core.quant.has_gemm(dtype)
    if dtype == "bf16":  # f32 activations in the dot kernel, bf16 ones in the GEMM
        bound = BF16_ACT_BOUND if cpu_gemm else F32_BOUND
    elif tokens <= CPU_DOT_MAX_TOKENS:
        bound = cpu_vs_opencl_bound(dtype, tokens == 1 and dtype in OPENCL_Q8_DTYPES)
    else:
        bound = Q8_ACT_BOUND if dtype not in FLOAT_DTYPES and cpu_gemm else F32_BOUND
    assert R.nmse(o, c) < bound


QUANT_DTYPES = [d for d in WEIGHT_DTYPES if d not in FLOAT_DTYPES]


def has_superblocks(dtype):
    """256-element blocks (the k-quants, IQ4_XS) rather than 32-element ones."""
    return dtype.endswith("_k") or dtype == "iq4_xs"


def odd_block_k(dtype):
    """A row length with an odd number of blocks: 3 super-blocks of 256, or 25 blocks of 32 (the
    cpu family's one-token kernel takes blocks in pairs, then the last one alone)."""
    return 768 if has_superblocks(dtype) else 800


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_linear_one_token_odd_block_count(cpu, ocl, rng, dtype):
    K, N = odd_block_k(dtype), 101  # N: no multiple of the work-group size
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    raw, wref = encode_weight(w, dtype)
    outs = {}
    for name, be in (("cpu", cpu), ("opencl", ocl)):
        out = be.empty("f32", [1, N])
        be.linear(be.tensor(x), upload_weight(be, raw, dtype, (N, K)), be.tensor(bias), out)
        outs[name] = out.numpy()
    assert R.nmse(outs["opencl"], opencl_decode_x(x, dtype).astype(np.float64) @ wref.T + bias) < 1e-10
    assert R.nmse(outs["opencl"], outs["cpu"]) < cpu_vs_opencl_bound(dtype, dtype in OPENCL_Q8_DTYPES)


@pytest.mark.parametrize("dtype", OPENCL_Q8_DTYPES)
def test_portable_kernels_equal_the_x86_ones(rng, dtype, monkeypatch):
    """The cpu family's weight kernels in their portable OpenCL C forms give pocl's x86 builtin
    forms (vpmaddubsw integer sums, vcvtph2ps scales, vpmovm2b fifth bits) bit for bit: exact
    integers and conversions, then the same float ops. A batch of decodes covers linear_q8, a
    short prompt's experts moe_rows_q8, a scoring step linear_t1, and embedding rows."""
    ocl = _core.make_backend("opencl", opencl_kernels="cpu")
    monkeypatch.setenv("FERRUM_OPENCL_PORTABLE", "1")
    portable = _core.make_backend("opencl", opencl_kernels="cpu")  # programs with -DPORTABLE_KERNELS
    K, N, T = 512, 40, 3
    x = rng.standard_normal((T, K)).astype(np.float32)
    raw, _ = encode_weight(rng.standard_normal((N, K)).astype(np.float32), dtype)

    def run(be, rows, decode_rows=0, float_activations=False):
        w = upload_weight(be, raw, dtype, (N, K))
        emb = be.empty("f32", [3, K])
        be.embedding(be.tensor(np.array([0, 39, 7], np.int32)), w, emb)
        return linear_on_stream(be, rows, w, N, decode_rows, float_activations), emb.numpy()

    for args in ((x, T), (x[:1], 0, True)):
        for a, b in zip(run(portable, *args), run(ocl, *args)):
            np.testing.assert_array_equal(a, b)
    moe_portable, moe_x86, _ = moe_parity(portable, ocl, rng, [dtype] * 3, T)
    np.testing.assert_array_equal(moe_portable, moe_x86)


@pytest.mark.parametrize("dtype", OPENCL_Q8_DTYPES)
def test_linear_decode_batch_equals_each_decode_alone(ocl, rng, dtype):
    """A batch of decodes (decode_rows) takes the one-token path row by row: each row's result is
    the row's alone, bit for bit, whatever the batch. A prompt of the same rows keeps f32
    activations, as does a one-token scoring stream (float_activations)."""
    K, N, T = 512, 70, 5
    x = rng.standard_normal((T, K)).astype(np.float32)
    raw, wref = encode_weight(rng.standard_normal((N, K)).astype(np.float32), dtype)
    W = upload_weight(ocl, raw, dtype, (N, K))

    def run(rows, decode_rows=0, float_activations=False):
        return linear_on_stream(ocl, rows, W, N, decode_rows, float_activations)

    batch = run(x, decode_rows=T)
    for t in range(T):
        np.testing.assert_array_equal(batch[t], run(x[t:t + 1])[0])
    assert R.nmse(batch, q8_0_round_trip(x).astype(np.float64) @ wref.T) < 1e-10
    assert R.nmse(run(x), x.astype(np.float64) @ wref.T) < 1e-10
    assert R.nmse(run(x[:1], float_activations=True), x[:1].astype(np.float64) @ wref.T) < 1e-10


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tokens,k", [(1, 130), (6, 77)])
def test_linear_parity_float_weights_odd_k(cpu, ocl, rng, dtype, tokens, k):
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = rng.standard_normal((11, k)).astype(np.float32)
    raw, _ = encode_weight(w, dtype)
    outs = []
    for be in (cpu, ocl):
        out = be.empty("f32", [tokens, 11])
        be.linear(be.tensor(x), upload_weight(be, raw, dtype, w.shape), None, out)
        outs.append(out.numpy())
    assert R.nmse(outs[1], outs[0]) < F32_BOUND


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_embedding_parity_exact(cpu, ocl, rng, dtype):
    table = rng.standard_normal((50, 512)).astype(np.float32)
    raw, tref = encode_weight(table, dtype)
    ids = np.array([0, 49, 7, 7, -1, 23, 50], np.int32)  # -1 and 50: out of range -> zero rows
    outs = []
    for be in (cpu, ocl):
        out = be.empty("f32", [len(ids), 512])
        be.embedding(be.tensor(ids), upload_weight(be, raw, dtype, table.shape), out)
        outs.append(out.numpy())
    expect = np.where((ids[:, None] >= 0) & (ids[:, None] < 50), tref[np.clip(ids, 0, 49)], 0).astype(np.float32)
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[1], expect)


def both(cpu, ocl, fn):
    """Runs fn(backend) on both backends; returns (cpu result, opencl result)."""
    return fn(cpu), fn(ocl)


def test_norms_swiglu_parity(cpu, ocl, rng):
    x = rng.standard_normal((7, 333)).astype(np.float32)
    r = rng.standard_normal((7, 333)).astype(np.float32)
    w = rng.standard_normal(333).astype(np.float32)
    gu = rng.standard_normal((7, 2 * 333)).astype(np.float32)

    def run(be):
        out, res, norm2 = be.empty("f32", [7, 333]), be.tensor(r), be.empty("f32", [7, 333])
        be.rms_norm(be.tensor(x), be.tensor(w), 1e-5, out)
        be.add_rms_norm(res, be.tensor(x), be.tensor(w), 1e-6, norm2)
        sw = be.empty("f32", [7, 333])
        be.swiglu(be.tensor(gu), sw)
        return [out.numpy(), res.numpy(), norm2.numpy(), sw.numpy()]

    for c, o in zip(*both(cpu, ocl, run)):
        assert R.nmse(o, c) < F32_BOUND


def test_gather_exact(cpu, ocl, rng):
    x = rng.standard_normal((9, 1001)).astype(np.float32)
    idx = np.array([8, 0, 4, 4, -1, 9], np.int32)  # -1 and 9: zero rows

    def run(be):
        g = be.empty("f32", [6, 1001])
        be.gather_rows(be.tensor(x), be.tensor(idx), g)
        return g.numpy()

    c, o = both(cpu, ocl, run)
    np.testing.assert_array_equal(o, c)
    assert (o[4:] == 0).all()


@pytest.mark.parametrize("rows", [1, 6])
def test_group_offsets_parity(cpu, ocl, rng, rows):
    from test_ops import group_offsets_case
    x, block_groups, offsets, out = group_offsets_case(rng, rows, blocks=20, groups=5, n=70, width=75)

    def run(be):
        got = be.tensor(out)
        be.add_group_offsets(be.tensor(x), be.tensor(block_groups), be.tensor(offsets), got)
        return got.numpy()

    c, o = both(cpu, ocl, run)
    assert R.nmse(o, c) < F32_BOUND


@pytest.mark.parametrize("layout", ["half_split", "interleaved"])
def test_rope_parity_partial_rotary_and_padding(cpu, ocl, rng, layout):
    T, H, hd, rot = 5, 3, 80, 32  # rotate only the first 32 dims (cos/sin have 16 columns)
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.array([0, 3, 700, -1, 1023], np.int32)  # -1: padding, left unrotated
    cos, sin = R.rope_tables(1024, rot, 1e4)

    c, o = both(cpu, ocl, lambda be: rope_query_heads(be, x, pos, cos, sin, layout))
    assert R.nmse(o, c) < F32_BOUND
    np.testing.assert_array_equal(o[3], x[3])
    np.testing.assert_array_equal(o[:, :, rot:], x[:, :, rot:])


def attention_step(be, rng_seed, kv_dtype, H, KV, hd, window, qk_norm, layout, seq_lens=(41, 17, 30),
                   new=(1, 17, 5), max_blocks=3, unmapped=()):
    """Two varlen steps (history, then new tokens of three sequences plus two padding rows) on
    one backend; returns q_out, the attention output and the pool rows the steps wrote.
    unmapped: (sequence, block index) entries of the block tables left at -1 (their positions are
    neither written nor attended to)."""
    rng = np.random.default_rng(rng_seed)
    bs = 16
    blocks = 3 * max_blocks + 2
    tables = rng.permutation(blocks)[:3 * max_blocks].reshape(3, max_blocks).astype(np.int32)
    for seq, block in unmapped:
        tables[seq, block] = -1
    shape = [blocks, KV, bs, hd]
    k, v = be.empty(kv_dtype, shape), be.empty(kv_dtype, shape)
    kv = _core.KvLayer(k, v, be.empty("f32", shape[:3]), be.empty("f32", shape[:3])) if kv_dtype == "i8" \
        else _core.KvLayer(k, v)
    cos, sin = R.rope_tables(max(256, max_blocks * bs), hd, 1e4)
    rope = _core.RopeTable(be.tensor(cos.astype(np.float32)), be.tensor(sin.astype(np.float32)),
                           getattr(_core.RopeLayout, layout))
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), window)
    qn = be.tensor(rng.standard_normal(hd).astype(np.float32)) if qk_norm else None
    kn = be.tensor(rng.standard_normal(hd).astype(np.float32)) if qk_norm else None
    qkv_all = [rng.standard_normal((n, (H + 2 * KV) * hd)).astype(np.float32) for n in seq_lens]
    slot_of = lambda s, p: tables[s, p // bs] * bs + p % bs if p >= 0 and tables[s, p // bs] >= 0 else -1

    def step(rows, pad):
        seq = np.concatenate([np.full(c, s) for s, f, c in rows] + [np.zeros(pad)]).astype(np.int32)
        pos = np.concatenate([np.arange(f, f + c) for s, f, c in rows] + [np.full(pad, -1)]).astype(np.int32)
        slots = np.array([slot_of(s, p) for s, p in zip(seq, pos)], np.int32)
        x = np.concatenate([qkv_all[s][f:f + c] for s, f, c in rows] + [np.zeros((pad, qkv_all[0].shape[1]), np.float32)])
        batch = _core.AttnBatch(be.tensor(seq), be.tensor(pos), be.tensor(slots), be.tensor(tables))
        T = len(seq)
        q_out, out = be.tensor(np.zeros((T, H, hd), np.float32)), be.tensor(np.zeros((T, H, hd), np.float32))
        be.qkv_to_cache(be.tensor(x), qn, kn, 1e-6, rope, batch, params, q_out, kv)
        be.paged_attention(q_out, kv, batch, params, out)
        return q_out.numpy(), out.numpy(), slots

    step([(s, 0, seq_lens[s] - new[s]) for s in range(3) if seq_lens[s] > new[s]], 0)
    q_out, out, slots = step([(s, seq_lens[s] - new[s], new[s]) for s in range(3)], 2)
    written = [slot_of(s, p) for s in range(3) for p in range(seq_lens[s])]
    written = np.array([w for w in written if w >= 0])
    rows_of = lambda pool: pool.astype(np.float32).reshape(blocks, KV, bs, hd).transpose(0, 2, 1, 3).reshape(blocks * bs, KV, hd)[written]
    return q_out, out, rows_of(logical_k(be, k.numpy())), rows_of(v.numpy())


def logical_k(be, pool):
    """A K pool as [blocks, kv_heads, block_size, head_dim] rows: the CPU backend stores each
    16 rows as a panel, dimension-major (cpu_kernels.h), when the block size is a multiple of 16."""
    blocks, kv, bs, hd = pool.shape
    if be.name != "cpu" or bs % 16:
        return pool
    return pool.reshape(blocks, kv, bs // 16, hd, 16).swapaxes(3, 4).reshape(pool.shape)


@pytest.mark.parametrize("kv_dtype,bound", [("f32", F32_BOUND), ("f16", 1e-8), ("i8", 1e-6)])
@pytest.mark.parametrize("H,KV,hd,window,qk_norm,layout", [
    (8, 2, 64, 0, False, "half_split"),
    (6, 6, 80, 0, True, "interleaved"),
    (8, 1, 128, 7, False, "half_split"),
    (4, 2, 8, 0, False, "interleaved"),  # stories260K's head_dim
])
def test_qkv_to_cache_and_paged_attention_parity(cpu, ocl, kv_dtype, bound, H, KV, hd, window, qk_norm, layout):
    c = attention_step(cpu, 5, kv_dtype, H, KV, hd, window, qk_norm, layout)
    o = attention_step(ocl, 5, kv_dtype, H, KV, hd, window, qk_norm, layout)
    valid = slice(0, -2)  # the last two rows are padding tokens (no position, no slot)
    assert R.nmse(o[0][valid], c[0][valid]) < F32_BOUND  # q_out is f32 on both
    assert R.nmse(o[1][valid], c[1][valid]) < bound
    assert R.nmse(o[2], c[2]) < bound and R.nmse(o[3], c[3]) < bound  # the pool rows written


@pytest.mark.parametrize("kv_dtype,bound", [("f32", F32_BOUND), ("f16", 1e-8)])
@pytest.mark.parametrize("window", [0, 300])
def test_decode_attention_over_long_contexts_parity(cpu, ocl, kv_dtype, bound, window):
    """Decodes of three sequences at positions 699, 299 and 40 over a pool of 768 positions per
    sequence (the gpu family splits each decode's positions into work-groups of 256 and combines
    the splits' softmaxes), a block of the first sequence unmapped, with and without a sliding
    window; the long history itself is one prompt step (the gpu family's per-token path)."""
    args = dict(seq_lens=(700, 300, 41), new=(1, 1, 1), max_blocks=48, unmapped=[(0, 20)])
    c = attention_step(cpu, 6, kv_dtype, 8, 2, 64, window, False, "half_split", **args)
    o = attention_step(ocl, 6, kv_dtype, 8, 2, 64, window, False, "half_split", **args)
    valid = slice(0, -2)
    assert R.nmse(o[0][valid], c[0][valid]) < F32_BOUND
    assert R.nmse(o[1][valid], c[1][valid]) < bound
    assert R.nmse(o[2], c[2]) < bound and R.nmse(o[3], c[3]) < bound


# --- mixture of experts ---------------------------------------------------------------------

@pytest.mark.parametrize("T,E,k,normalize", [(1, 8, 2, True), (9, 16, 4, False), (33, 128, 8, True),
                                             (5, 6, 6, False)])
def test_moe_route_parity(cpu, ocl, rng, T, E, k, normalize):
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    logits[0, 1] = logits[0, 3] = logits[0].max() + 1  # a tie at the top: the lower id first

    def run(be):
        ids, w = be.empty("i32", [T, k]), be.empty("f32", [T, k])
        be.moe_route(be.tensor(logits), k, normalize, ids, w)
        return ids.numpy(), w.numpy()

    (ci, cw), (oi, ow) = both(cpu, ocl, run)
    np.testing.assert_array_equal(oi, ci)
    assert oi[0, 0] == 1 and oi[0, 1] == 3 if k >= 2 else oi[0, 0] == 1
    assert R.nmse(ow, cw) < F32_BOUND


def moe_parity(cpu, ocl, rng, dtypes, T, E=8, I=256, H=512, k=2, ids=None):
    """moe_experts on both backends over the same experts in dtypes (gate, up, down); returns
    (cpu out, opencl out, float64 reference over the values the backends see)."""
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    raws, vals = [], []
    for shape, dtype in zip(shapes, dtypes):
        w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        raw, ref = encode_weight(w.reshape(-1, shape[-1]), dtype)
        raws.append(raw.reshape(shape) if dtype in ("f32", "f16") else raw)
        vals.append(ref.reshape(shape))
    x = rng.standard_normal((T, H)).astype(np.float32)
    if ids is None:
        ids = np.stack([rng.choice(E, k, replace=False, p=0.5 ** np.arange(E) / (2 - 2 * 0.5 ** E))
                        for _ in range(T)]).astype(np.int32)
    w = rng.random(ids.shape).astype(np.float32)

    def run(be):
        out = be.tensor(np.full((T, H), 7.0, np.float32))
        tensors = [upload_weight(be, r, d, s) for r, d, s in zip(raws, dtypes, shapes)]
        be.moe_experts(be.tensor(x), *tensors, be.tensor(ids), be.tensor(w), out)
        return out.numpy()

    c, o = both(cpu, ocl, run)
    return c, o, R.moe_experts(x, *vals, ids, w)


def opencl_moe_bound(dtypes, T, E=8, k=2):
    """OpenCL moe_experts against float64: f32 accuracy, but where it runs a row dot per pair (a
    prompt with fewer than 8 pairs per expert) over a type with integer dots, which quantizes the
    activations to Q8_0 twice (x, then the SwiGLU output) as linear does for decodes: 1e-3, the
    bound tests/test_moe_ops.py puts on the CPU's quantized experts (measured up to 1.9e-4 over
    4 seeds of these tests)."""
    quantizes = T * k < 8 * E and any(d in OPENCL_Q8_DTYPES for d in dtypes)
    return MOE_Q8_ACT_VS_EXACT_BOUND if quantizes else 1e-10


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_moe_experts_parity(cpu, ocl, rng, dtype, tokens):
    c, o, ref = moe_parity(cpu, ocl, rng, [dtype] * 3, tokens)
    assert R.nmse(o, ref) < opencl_moe_bound([dtype] * 3, tokens)
    assert R.nmse(o, c) < moe_bound([dtype] * 3)


def moe_bound(dtypes):
    if all(d in FLOAT_DTYPES for d in dtypes):
        return F32_BOUND
    return MOE_Q8K_ACT_BOUND if any(cpu_uses_q8k(d) for d in dtypes) else Q8_ACT_BOUND


@pytest.mark.parametrize("dtypes", [("q4_k", "q4_k", "q6_k"), ("f16", "q8_0", "bf16"), ("q5_0", "f32", "q4_1")])
def test_moe_experts_parity_mixed_dtypes(cpu, ocl, rng, dtypes):
    c, o, ref = moe_parity(cpu, ocl, rng, dtypes, 6)
    assert R.nmse(o, ref) < opencl_moe_bound(dtypes, 6)
    assert R.nmse(o, c) < moe_bound(dtypes)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_moe_experts_parity_odd_block_counts(cpu, ocl, rng, dtype):
    """Quantized experts with an odd number of blocks per row; for the 32-element types also
    expert widths (96) that leave the last work-group of each (token, slot) pair part empty."""
    H, I = (odd_block_k(dtype), 256) if has_superblocks(dtype) else (odd_block_k(dtype), 96)
    c, o, ref = moe_parity(cpu, ocl, rng, [dtype] * 3, 3, E=6, I=I, H=H, k=2)
    assert R.nmse(o, ref) < opencl_moe_bound([dtype] * 3, 3, E=6)
    assert R.nmse(o, c) < moe_bound([dtype] * 3)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_moe_experts_parity_odd_sizes_and_bad_ids(cpu, ocl, rng, dtype):
    """Widths that are not multiples of 32 (float experts), ids outside [0, E): no contribution."""
    ids = np.array([[0, -1, 2], [6, 5, 5], [-7, 100, 1], [-1, -1, -1]], np.int32)
    c, o, ref = moe_parity(cpu, ocl, rng, [dtype] * 3, 4, E=6, I=40, H=72, k=3, ids=ids)
    assert (o[3] == 0).all() and (c[3] == 0).all()
    assert R.nmse(o, ref) < 1e-10
    assert R.nmse(o, c) < F32_BOUND
