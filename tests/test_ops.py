"""Rung 1: every backend op against a float64 numpy reference, over many shapes."""
import numpy as np
import pytest

import reference as R
from ferrum import _core

F32_TOL = 1e-10  # NMSE for f32 paths
# NMSE of a product whose activations were rounded to bf16 (relative error up to 2^-8; measured
# NMSE 2.2e-6 .. 3.2e-6): the CPU's bf16 GEMM for prefill (more than 8 rows, not a scoring step).
BF16_ACT_TOL = 1e-5
CPU_DOT_MAX_TOKENS = 8  # cpp/backend/cpu/cpu_linear.cpp: kMaxDotTokens


def f16_bits(a):
    return np.asarray(a, np.float32).astype(np.float16)


def bf16_bits(a):
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def weight(be, w, dtype):
    """Backend tensor for weights w in dtype, and the values the backend actually sees."""
    if dtype == "f32":
        return be.tensor(w), w.astype(np.float64)
    if dtype == "f16":
        h = f16_bits(w)
        return be.tensor(h), h.astype(np.float64)
    b = bf16_bits(w)
    return be.tensor_raw(b, "bf16", list(w.shape)), bf16_to_f32(b).astype(np.float64)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("tokens,k,n", [(1, 64, 33), (1, 577, 129), (3, 96, 40), (17, 130, 71), (40, 256, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(backend, rng, dtype, tokens, k, n, bias):
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    W, wref = weight(backend, w, dtype)
    ref = x.astype(np.float64) @ wref.T + (b if bias else 0)

    def run(float_activations):
        s = backend.stream()
        s.float_activations = float_activations
        out = backend.empty("f32", [tokens, n])
        backend.linear(backend.tensor(x), W, backend.tensor(b) if bias else None, out, stream=s)
        s.submit()
        s.sync()
        return out.numpy()

    # A scoring step keeps f32 activations: the product to f32 accuracy.
    assert R.nmse(run(True), ref) < F32_TOL
    # Otherwise only the CPU's bf16 GEMM rounds activations (to bf16).
    rounds = (backend.name == "cpu" and dtype == "bf16" and tokens > CPU_DOT_MAX_TOKENS
              and _core.quant.has_gemm(dtype))
    assert R.nmse(run(False), ref) < (BF16_ACT_TOL if rounds else F32_TOL)


SCORING_DTYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"]


def quantized_weight(be, rng, dtype, n, k):
    """A random [n, k] weight in dtype on be, and its dequantized values as float64."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = [_core.quant.quantize(dtype, row) for row in w]
    values = np.stack([_core.quant.dequantize(dtype, r, k) for r in raw]).astype(np.float64)
    return be.tensor_raw(np.concatenate(raw), dtype, [n, k]), values


def linear_on_stream(be, rows, w, n, decode_rows=0, float_activations=False):
    """rows @ w.T through a stream marked as a batch of decode_rows decodes and / or scoring."""
    s = be.stream()
    s.decode_rows, s.float_activations = decode_rows, float_activations
    out = be.empty("f32", [len(rows), n])
    be.linear(be.tensor(rows), w, None, out, stream=s)
    s.submit()
    s.sync()
    return out.numpy()


@pytest.mark.parametrize("dtype", SCORING_DTYPES)
@pytest.mark.parametrize("tokens", [3, 33])
def test_quantized_linear_float_activations_for_scoring(backend, rng, dtype, tokens):
    """A stream marked float_activations (a scoring step) keeps f32 activations for quantized
    weights at any row count: the result is the dequantized weights' product to f32 accuracy.
    Unmarked, the CPU may quantize activations to 8 bits (dot kernels, int8 GEMM)."""
    k, n = 256, 40
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    W, wref = quantized_weight(backend, rng, dtype, n, k)
    ref = x.astype(np.float64) @ wref.T
    assert R.nmse(linear_on_stream(backend, x, W, n, float_activations=True), ref) < F32_TOL
    assert R.nmse(linear_on_stream(backend, x, W, n), ref) < 3e-4


@pytest.mark.parametrize("dtype", SCORING_DTYPES)
def test_float_activations_one_row_as_exact_as_many(backend, rng, dtype):
    """A one-row matmul recorded for scoring keeps f32 activations too (a decode's row would be
    quantized to 8 bits): each row alone is as close to the f32 reference as the rows of one
    many-row scoring call, and equals that call's row to f32 accuracy."""
    k, n, tokens = 256, 40, 5
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    W, wref = quantized_weight(backend, rng, dtype, n, k)
    ref = x.astype(np.float64) @ wref.T
    many = linear_on_stream(backend, x, W, n, float_activations=True)
    assert R.nmse(many, ref) < F32_TOL
    for t in range(tokens):
        alone = linear_on_stream(backend, x[t:t + 1], W, n, float_activations=True)[0]
        assert R.nmse(alone, ref[t]) < F32_TOL
        assert R.nmse(alone, many[t]) < F32_TOL


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_embedding(backend, rng, dtype):
    table = rng.standard_normal((50, 72)).astype(np.float32)
    ids = np.array([0, 49, 7, 7, 23], np.int32)
    T, tref = weight(backend, table, dtype)
    out = backend.empty("f32", [5, 72])
    backend.embedding(backend.tensor(ids), T, out)
    np.testing.assert_array_equal(out.numpy(), tref[ids].astype(np.float32))


@pytest.mark.parametrize("rows,d", [(1, 64), (7, 80), (13, 576), (4, 1000)])
def test_rms_norm(backend, rng, rows, d):
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = backend.empty("f32", [rows, d])
    backend.rms_norm(backend.tensor(x), backend.tensor(w), 1e-6, out)
    assert R.nmse(out.numpy(), R.rms_norm(x, w, 1e-6)) < F32_TOL


def test_qk_norm_is_rms_norm_per_head(backend, rng):
    q = rng.standard_normal((3, 5, 128)).astype(np.float32)  # [T, H, hd]
    w = rng.standard_normal(128).astype(np.float32)
    Q = backend.tensor(q)
    out = backend.empty("f32", [15, 128])
    backend.rms_norm(Q.reshape([15, 128]), backend.tensor(w), 1e-6, out)
    assert R.nmse(out.numpy().reshape(q.shape), R.rms_norm(q, w, 1e-6)) < F32_TOL


@pytest.mark.parametrize("rows,d", [(1, 64), (9, 333)])
def test_add_rms_norm(backend, rng, rows, d):
    res = rng.standard_normal((rows, d)).astype(np.float32)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    RES, out = backend.tensor(res), backend.empty("f32", [rows, d])
    backend.add_rms_norm(RES, backend.tensor(x), backend.tensor(w), 1e-5, out)
    s = res.astype(np.float64) + x
    assert R.nmse(RES.numpy(), s) < F32_TOL
    assert R.nmse(out.numpy(), R.rms_norm(s, w, 1e-5)) < F32_TOL


def rope_query_heads(be, x, pos, cos, sin, layout):
    """x [T, H, hd] as qkv_to_cache rotates query heads (no QK-norm) at positions pos, with cos /
    sin [max_pos, rot / 2]. The tokens are padding for the pool (slot -1): only q_out is written."""
    T, H, hd = x.shape
    qkv = np.concatenate([x.reshape(T, H * hd), np.zeros((T, 2 * hd), np.float32)], axis=1)  # + a K and a V head
    table = _core.RopeTable(be.tensor(cos.astype(np.float32)), be.tensor(sin.astype(np.float32)),
                            getattr(_core.RopeLayout, layout))
    batch = _core.AttnBatch(be.tensor(np.zeros(T, np.int32)), be.tensor(np.asarray(pos, np.int32)),
                            be.tensor(np.full(T, -1, np.int32)), be.tensor(np.zeros((1, 1), np.int32)))
    q_out = be.empty("f32", [T, H, hd])
    be.qkv_to_cache(be.tensor(qkv), None, None, 1e-6, table, batch, _core.AttnParams(H, 1, hd, 1.0), q_out,
                    make_pool(be, 1, 1, 16, hd, "f32"))
    return q_out.numpy()


@pytest.mark.parametrize("layout", ["half_split", "interleaved"])
@pytest.mark.parametrize("hd", [64, 80, 128])
def test_rope(backend, rng, layout, hd):
    T, H = 6, 3
    x = rng.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.array([0, 1, 5, 17, 200, 511], np.int32)
    cos, sin = R.rope_tables(512, hd, 1e4)
    ref = R.rope(x, pos, cos, sin, layout == "interleaved")
    assert R.nmse(rope_query_heads(backend, x, pos, cos, sin, layout), ref) < 1e-9


def test_swiglu_gather(backend, rng):
    for rows, n in [(5, 77), (1, 1536)]:  # pieces across row ends; a decode's one row, split
        gu = rng.standard_normal((rows, 2 * n)).astype(np.float32)
        out = backend.empty("f32", [rows, n])
        backend.swiglu(backend.tensor(gu), out)
        assert R.nmse(out.numpy(), R.swiglu(gu)) < F32_TOL

    a = rng.standard_normal((4, 9)).astype(np.float32)
    idx = np.array([3, 0, 3], np.int32)
    g = backend.empty("f32", [3, 9])
    backend.gather_rows(backend.tensor(a), backend.tensor(idx), g)
    np.testing.assert_array_equal(g.numpy(), a[idx])


def group_offsets_case(rng, rows, blocks, groups, n, width):
    """x [rows, 32 * blocks], blocks in groups out of order, offsets [groups, n], out wider than n."""
    x = rng.standard_normal((rows, 32 * blocks)).astype(np.float32)
    block_groups = rng.permutation(np.arange(blocks) % groups).astype(np.int32)
    offsets = rng.standard_normal((groups, n)).astype(np.float32)
    out = rng.standard_normal((rows, width)).astype(np.float32)
    return x, block_groups, offsets, out


@pytest.mark.parametrize("rows", [1, 5])  # a decode's row split by outputs; rows split by threads
def test_add_group_offsets(backend, rng, rows):
    x, block_groups, offsets, out = group_offsets_case(rng, rows, blocks=12, groups=4, n=100, width=104)
    sums = np.zeros((rows, 4))
    for b, g in enumerate(block_groups):
        sums[:, g] += x[:, 32 * b:32 * b + 32].astype(np.float64).sum(1)
    want = out.astype(np.float64)
    want[:, :100] += sums @ offsets.astype(np.float64)
    got = backend.tensor(out)
    backend.add_group_offsets(backend.tensor(x), backend.tensor(block_groups), backend.tensor(offsets), got)
    assert R.nmse(got.numpy(), want) < F32_TOL
    np.testing.assert_array_equal(got.numpy()[:, 100:], out[:, 100:])  # columns past the offsets' kept


def make_pool(backend, blocks, kv_heads, block_size, hd, kv_dtype):
    shape = [blocks, kv_heads, block_size, hd]
    k, v = backend.empty(kv_dtype, shape), backend.empty(kv_dtype, shape)
    if kv_dtype == "i8":
        ks, vs = backend.empty("f32", shape[:3]), backend.empty("f32", shape[:3])
        return _core.KvLayer(k, v, ks, vs)
    return _core.KvLayer(k, v)


def run_attention_case(backend, rng, seq_lens, new_lens, H, KV, hd, window=0, kv_dtype="f32",
                       qk_norm=False, layout="half_split", block_size=16):
    """Prefill every sequence's history, then one varlen call with each sequence's new tokens;
    compare q_out, the cache contents and attention against numpy."""
    S = len(seq_lens)
    max_blocks = max((L + block_size - 1) // block_size for L in seq_lens)
    num_blocks = S * max_blocks + 3
    perm = rng.permutation(num_blocks)  # scattered physical blocks
    tables = perm[:S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    kv = make_pool(backend, num_blocks, KV, block_size, hd, kv_dtype)
    cos, sin = R.rope_tables(1024, hd, 1e4)
    rope = _core.RopeTable(backend.tensor(cos.astype(np.float32)), backend.tensor(sin.astype(np.float32)),
                           getattr(_core.RopeLayout, layout))
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), window)
    qn = rng.standard_normal(hd).astype(np.float32) if qk_norm else None
    kn = rng.standard_normal(hd).astype(np.float32) if qk_norm else None

    # Every token of every sequence, in two phases: history (L - new) then the new tokens.
    qkv = {s: rng.standard_normal((seq_lens[s], (H + 2 * KV) * hd)).astype(np.float32) for s in range(S)}
    k_ref, v_ref, q_ref = {}, {}, {}
    for s in range(S):
        t = qkv[s]
        q = t[:, :H * hd].reshape(-1, H, hd)
        k = t[:, H * hd:(H + KV) * hd].reshape(-1, KV, hd)
        v = t[:, (H + KV) * hd:].reshape(-1, KV, hd)
        if qk_norm:
            q, k = R.rms_norm(q, qn, 1e-6), R.rms_norm(k, kn, 1e-6)
        pos = np.arange(seq_lens[s])
        q_ref[s] = R.rope(q, pos, cos, sin, layout == "interleaved")
        k_ref[s] = R.rope(k, pos, cos, sin, layout == "interleaved")
        v_ref[s] = v.astype(np.float64)

    def step(rows):  # rows: list of (seq, first, count)
        tok_seq = np.concatenate([np.full(c, s) for s, f, c in rows]).astype(np.int32)
        tok_pos = np.concatenate([np.arange(f, f + c) for s, f, c in rows]).astype(np.int32)
        slots = np.array([tables[s, p // block_size] * block_size + p % block_size
                          for s, p in zip(tok_seq, tok_pos)], np.int32)
        x = np.concatenate([qkv[s][f:f + c] for s, f, c in rows])
        T = len(tok_seq)
        batch = _core.AttnBatch(backend.tensor(tok_seq), backend.tensor(tok_pos), backend.tensor(slots),
                                backend.tensor(tables))
        q_out = backend.empty("f32", [T, H, hd])
        backend.qkv_to_cache(backend.tensor(x), None if qn is None else backend.tensor(qn),
                             None if kn is None else backend.tensor(kn), 1e-6, rope, batch, params, q_out, kv)
        out = backend.empty("f32", [T, H, hd])
        backend.paged_attention(q_out, kv, batch, params, out)
        return tok_seq, tok_pos, q_out.numpy(), out.numpy()

    hist = [(s, 0, seq_lens[s] - new_lens[s]) for s in range(S) if seq_lens[s] > new_lens[s]]
    if hist:
        step(hist)
    tok_seq, tok_pos, q_out, out = step([(s, seq_lens[s] - new_lens[s], new_lens[s]) for s in range(S)])
    q_expect = np.stack([q_ref[s][p] for s, p in zip(tok_seq, tok_pos)])
    assert R.nmse(q_out, q_expect) < 1e-9
    ref = R.attention(q_expect, k_ref, v_ref, tok_seq, tok_pos, window)
    return R.nmse(out, ref)


@pytest.mark.parametrize("H,KV", [(4, 4), (8, 4), (6, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("hd", [64, 80, 128])
def test_paged_attention_gqa_head_dims(backend, rng, H, KV, hd):
    # three sequences: a decode token after 40 cached, a prefill of 17 (straddles a block), a
    # chunk of 5 after 11 cached
    err = run_attention_case(backend, rng, [41, 17, 16], [1, 17, 5], H, KV, hd)
    assert err < 1e-9


@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_paged_attention_sliding_window(backend, rng, window):
    assert run_attention_case(backend, rng, [50, 9], [3, 9], 4, 2, 64, window=window) < 1e-9


@pytest.mark.parametrize("layout", ["half_split", "interleaved"])
def test_qkv_to_cache_qk_norm(backend, rng, layout):
    assert run_attention_case(backend, rng, [20, 33], [20, 1], 8, 2, 64, qk_norm=True, layout=layout) < 1e-9


@pytest.mark.parametrize("kv_dtype,bound", [("f16", 1e-5), ("i8", 1e-3)])
def test_paged_attention_low_precision_kv(backend, rng, kv_dtype, bound):
    assert run_attention_case(backend, rng, [37, 5], [2, 5], 4, 2, 64, kv_dtype=kv_dtype) < bound


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("kv_dtype,bound", [("f32", 1e-9), ("f16", 1e-5), ("i8", 1e-3)])
def test_paged_attention_block_sizes(backend, rng, block_size, kv_dtype, bound):
    # pool blocks of 8 keys (a 16-key block of the CPU kernel spans two pool blocks) and of 32
    # (its key blocks start mid-block)
    err = run_attention_case(backend, rng, [41, 17, 16], [1, 17, 5], 8, 2, 64, kv_dtype=kv_dtype,
                             block_size=block_size)
    assert err < bound


@pytest.mark.parametrize("H,KV,hd", [(9, 3, 64), (8, 1, 64), (7, 1, 64), (6, 2, 128), (8, 2, 128), (6, 2, 80)])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "i8"])
def test_paged_attention_token_independent_of_its_tile(backend, rng, H, KV, hd, kv_dtype):
    """A token's output is bit for bit the same alone (a decode), inside a prefill tile, and next
    to other sequences' tokens: the engine's batched == alone and chunked == one-shot rest on it.
    The head groups cover every way the CPU kernel splits a kv head's query rows."""
    bs, L, T = 16, 45, 13  # the last T of L tokens straddle two key blocks
    kv = make_pool(backend, 8, KV, bs, hd, kv_dtype)
    tables = np.array([[5, 2, 7], [0, 6, 3]], np.int32)  # a second sequence, to batch with
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), 0)
    cos, sin = R.rope_tables(64, hd, 1e4)
    rope = _core.RopeTable(backend.tensor(cos.astype(np.float32)), backend.tensor(sin.astype(np.float32)),
                           _core.RopeLayout.half_split)
    tab = backend.tensor(tables)

    def batch(seqs, positions):
        seqs, positions = np.asarray(seqs, np.int32), np.asarray(positions, np.int32)
        slots = (tables[seqs, positions // bs] * bs + positions % bs).astype(np.int32)
        return _core.AttnBatch(backend.tensor(seqs), backend.tensor(positions), backend.tensor(slots), tab)

    qkv = rng.standard_normal((2 * L, (H + 2 * KV) * hd)).astype(np.float32)
    fill = batch([0] * L + [1] * L, list(range(L)) * 2)
    q = backend.empty("f32", [2 * L, H, hd])
    backend.qkv_to_cache(backend.tensor(qkv), None, None, 1e-6, rope, fill, params, q, kv)
    q_all = q.numpy()

    def attend(rows):  # rows: (seq, pos) pairs, one call
        seqs, positions = zip(*rows)
        qs = np.stack([q_all[s * L + p] for s, p in rows])
        out = backend.empty("f32", [len(rows), H, hd])
        backend.paged_attention(backend.tensor(qs), kv, batch(seqs, positions), params, out)
        return out.numpy()

    tail = [(0, p) for p in range(L - T, L)]
    prefill = attend(tail)
    mixed = attend([(1, L - 1)] + tail + [(1, 3)])[1:-1]
    for i, row in enumerate(tail):
        np.testing.assert_array_equal(attend([row])[0], prefill[i])
    np.testing.assert_array_equal(mixed, prefill)


def test_stream_replay_reads_fresh_inputs(backend, rng):
    """A recorded stream re-run after its input buffers change computes on the new values."""
    w = rng.standard_normal((16, 32)).astype(np.float32)
    W, X, out = backend.tensor(w), backend.empty("f32", [2, 32]), backend.empty("f32", [2, 16])
    s = backend.stream()
    backend.linear(X, W, None, out, stream=s)
    for _ in range(3):
        x = rng.standard_normal((2, 32)).astype(np.float32)
        X.upload(x)
        s.submit()
        s.sync()
        assert R.nmse(out.numpy(), x @ w.T) < F32_TOL
    assert len(s) >= 1


@pytest.mark.parametrize("call", [
    lambda be: be.linear(be.empty("f32", [2, 8]), be.empty("f32", [4, 9]), None, be.empty("f32", [2, 4])),
    lambda be: be.linear(be.empty("f32", [2, 8]), be.empty("f32", [4, 8]), be.empty("f32", [3]), be.empty("f32", [2, 4])),
    lambda be: be.rms_norm(be.empty("i32", [2, 8]), be.empty("f32", [8]), 1e-5, be.empty("f32", [2, 8])),
    lambda be: be.swiglu(be.empty("f32", [2, 8]), be.empty("f32", [2, 8])),
    lambda be: be.embedding(be.empty("f32", [2]), be.empty("f32", [4, 8]), be.empty("f32", [2, 8])),
    lambda be: be.tensor_raw(np.zeros(10, np.uint8), "q4_0", [1, 32]),
    lambda be: be.empty("q4_0", [3, 31]),
    lambda be: be.tensor(np.zeros(3, np.float64)),
    lambda be: be.supports("no_such_op"),
])
def test_bad_shapes_raise_value_error(backend, call):
    with pytest.raises(ValueError):
        call(backend)
