"""Rung 1 for the mixture-of-experts ops: moe_route and moe_experts against float64 numpy."""
import numpy as np
import pytest

import reference as R
from conftest import backend_names
from ferrum import _core
from ferrum.tools import quantize as Q
from test_ops import F32_TOL, weight

# Quantized experts: an expert chosen by few tokens (<= 8, or <= 64 where the weight types have
# a batched dot kernel) runs the dot kernels, which quantize the activations to 8 bits as
# llama.cpp does (measured NMSE vs float64 up to 1.4e-4 with Q8_0 activations, 2.8e-4 with the
# k-quants' Q8_K); one chosen by more dequantizes its weights and runs f32 sgemm (f32 accuracy). The dot path is also checked against the linear
# op it must equal (same kernels) to f32 accuracy.
QUANT_DOT_TOL = 1e-3


def moe_backends():
    """The backends that implement the MoE ops; the others must say they don't (tested below)."""
    return [n for n in backend_names() if _core.make_backend(n, 2).supports("moe_experts")]


@pytest.fixture(scope="module", params=moe_backends())
def backend(request):
    return _core.make_backend(request.param, 2)


@pytest.mark.parametrize("name", backend_names())
def test_backends_without_moe_say_so(name):
    be = _core.make_backend(name, 2)
    assert be.supports("moe_route") == be.supports("moe_experts")
    if be.supports("moe_experts"):
        assert name == "cpu" or name in moe_backends()
        return
    with pytest.raises(ValueError, match=f"moe_experts is not supported by the {name} backend"):
        be.moe_experts(be.empty("f32", [1, 32]), be.empty("f32", [2, 8, 32]), be.empty("f32", [2, 8, 32]),
                       be.empty("f32", [2, 32, 8]), be.empty("i32", [1, 1]), be.empty("f32", [1, 1]),
                       be.empty("f32", [1, 32]))
    with pytest.raises(ValueError, match=f"moe_route is not supported by the {name} backend"):
        be.moe_route(be.empty("f32", [1, 2]), 1, True, be.empty("i32", [1, 1]), be.empty("f32", [1, 1]))


def test_cpu_runs_moe():
    assert "cpu" in moe_backends()


def expert_weights(backend, rng, E, I, H, dtypes):
    """Backend tensors gate/up [E, I, H], down [E, H, I] in dtypes (gate, up, down), and the
    values the backend sees, as float64."""
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    tensors, values = [], []
    for (name, shape), dtype in zip(shapes.items(), dtypes):
        w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if dtype in Q.BLOCK_SIZES:
            blocks = Q.quantize(w, dtype)
            tensors.append(backend.tensor_raw(blocks.reshape(-1), dtype, list(shape)))
            values.append(Q.dequantize(blocks, dtype).reshape(shape).astype(np.float64))
        else:
            t, v = weight(backend, w, dtype)
            tensors.append(t)
            values.append(v)
    return tensors, values


def uneven_ids(rng, T, k, E):
    """Each token picks k distinct experts, skewed: low ids are popular, the top quarter of the
    experts is never picked."""
    p = 0.5 ** np.arange(E)
    p[E - E // 4:] = 0
    p /= p.sum()
    return np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(T)]).astype(np.int32)


def run_experts(backend, x, tensors, ids, w):
    out = backend.empty("f32", list(x.shape))
    backend.moe_experts(backend.tensor(x), *tensors, backend.tensor(ids), backend.tensor(w), out)
    return out.numpy()


def experts_on_stream(backend, x, tensors, ids, w, decode_rows=0, float_activations=False):
    """moe_experts through a stream marked as a batch of decode_rows decodes and / or scoring."""
    s = backend.stream()
    s.decode_rows, s.float_activations = decode_rows, float_activations
    out = backend.empty("f32", list(x.shape))
    backend.moe_experts(backend.tensor(x), *tensors, backend.tensor(ids), backend.tensor(w), out, stream=s)
    s.submit()
    s.sync()
    return out.numpy()


@pytest.mark.parametrize("T,E,k", [(1, 8, 1), (1, 16, 2), (7, 16, 4), (33, 128, 8), (5, 8, 8)])
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_route(backend, rng, T, E, k, normalize):
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    ids, w = backend.empty("i32", [T, k]), backend.empty("f32", [T, k])
    backend.moe_route(backend.tensor(logits), k, normalize, ids, w)
    ref_ids, ref_w = R.moe_route(logits, k, normalize)
    np.testing.assert_array_equal(ids.numpy(), ref_ids)
    assert R.nmse(w.numpy(), ref_w) < F32_TOL


def test_moe_route_ties_pick_the_lower_id(backend):
    logits = np.array([[0, 2, 1, 2, 2]], np.float32)
    ids, w = backend.empty("i32", [1, 3]), backend.empty("f32", [1, 3])
    backend.moe_route(backend.tensor(logits), 3, True, ids, w)
    np.testing.assert_array_equal(ids.numpy(), [[1, 3, 4]])
    np.testing.assert_allclose(w.numpy(), [[1 / 3] * 3], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 4), (3, 2), (40, 2), (24, 8)])
def test_moe_experts_float(backend, rng, dtype, T, k):
    E, I, H = 12, 40, 72  # not multiples of 16 / 32
    tensors, values = expert_weights(backend, rng, E, I, H, [dtype] * 3)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, tensors, ids, w)
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < F32_TOL


@pytest.mark.parametrize("dtypes", [("q8_0",) * 3, ("q4_0",) * 3, ("q4_k",) * 3,
                                    ("q4_k", "q4_k", "q6_k"), ("q5_k", "q8_0", "q6_k"),
                                    ("f16", "q8_0", "q6_k"), ("q8_0", "bf16", "f32")])
@pytest.mark.parametrize("T", [1, 4, 6, 50])
def test_moe_experts_quantized(backend, rng, dtypes, T):
    E, I, H, k = 8, 256, 512, 2
    tensors, values = expert_weights(backend, rng, E, I, H, dtypes)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, tensors, ids, w)
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < QUANT_DOT_TOL


def group_offsets(backend, rng, E, N, K, groups):
    """Asymmetric 8-bit experts' offsets: backend (offsets f32 [E, G, N], block_groups i32
    [K / 32]) with blocks dealt to groups unevenly, and what they add to each expert's [N, K]
    matrix, as float64."""
    block_groups = np.sort(rng.integers(0, groups, K // 32)).astype(np.int32)
    offsets = (rng.standard_normal((E, groups, N)) / np.sqrt(K)).astype(np.float32)
    dense = np.repeat(offsets[:, block_groups, :], 32, axis=1).transpose(0, 2, 1).astype(np.float64)  # [E, N, K]
    return (backend.tensor(offsets), backend.tensor(block_groups)), dense


# Each backend, OpenCL in both kernel families.
FAMILIES = [(n, f) for n in moe_backends() for f in (["cpu", "gpu"] if n == "opencl" else [""])]


@pytest.mark.parametrize("name,kernels", FAMILIES)
@pytest.mark.parametrize("T", [1, 3, 6, 50])  # decode, a small call, a shared plan, many pairs per expert
def test_moe_experts_group_offsets(rng, name, kernels, T):
    """Each expert's product adds its group offsets (zero points of asymmetric 8-bit weights)
    over the group sums of its input: as the dense weights they stand for."""
    be = _core.make_backend(name, 2, kernels)
    E, I, H, k = 8, 64, 128, 2
    tensors, values = expert_weights(be, rng, E, I, H, ("q8_0",) * 3)
    offsets, dense = {}, {}
    for name, (N, K, G) in {"gate": (I, H, 3), "up": (I, H, 1), "down": (H, I, 2)}.items():
        offsets[name], dense[name] = group_offsets(be, rng, E, N, K, G)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)
    w = rng.random((T, k)).astype(np.float32)
    out = be.empty("f32", [T, H])
    be.moe_experts(be.tensor(x), *tensors, be.tensor(ids), be.tensor(w), out, offsets=offsets)
    got = out.numpy()
    effective = [v + dense[n] for v, n in zip(values, ("gate", "up", "down"))]
    assert R.nmse(got, R.moe_experts(x, *effective, ids, w)) < QUANT_DOT_TOL
    assert R.nmse(run_experts(be, x, tensors, ids, w), R.moe_experts(x, *effective, ids, w)) > 100 * QUANT_DOT_TOL


@pytest.mark.parametrize("name,kernels", FAMILIES)
@pytest.mark.parametrize("T", [1, 3, 6, 50])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_moe_experts_input_orders(rng, name, kernels, T, with_offsets):
    """Act-order experts: each expert's stored column j holds its input order[e, j] (gate and up
    sharing one order, down its own), its offsets over the inputs so ordered."""
    be = _core.make_backend(name, 2, kernels)
    E, I, H, k = 8, 64, 128, 2
    tensors, values = expert_weights(be, rng, E, I, H, ("q8_0",) * 3)
    orders = {"gate_up": np.stack([rng.permutation(H) for _ in range(E)]).astype(np.int32),
              "down": np.stack([rng.permutation(I) for _ in range(E)]).astype(np.int32)}
    offsets = {}
    if with_offsets:
        for p, (N, K, G) in {"gate": (I, H, 2), "up": (I, H, 3), "down": (H, I, 2)}.items():
            offsets[p], dense = group_offsets(be, rng, E, N, K, G)
            values[("gate", "up", "down").index(p)] = values[("gate", "up", "down").index(p)] + dense
    effective = []  # the stored columns put back in input order
    for v, o in zip(values, (orders["gate_up"], orders["gate_up"], orders["down"])):
        w = np.empty_like(v)
        for e in range(E):
            w[e][:, o[e]] = v[e]
        effective.append(w)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)
    w = rng.random((T, k)).astype(np.float32)
    out = be.empty("f32", [T, H])
    be.moe_experts(be.tensor(x), *tensors, be.tensor(ids), be.tensor(w), out, offsets=offsets,
                   input_orders={n: be.tensor(o) for n, o in orders.items()})
    assert R.nmse(out.numpy(), R.moe_experts(x, *effective, ids, w)) < QUANT_DOT_TOL


@pytest.mark.parametrize("dtypes", [("q8_0",) * 3, ("q4_k", "q4_k", "q6_k")])
@pytest.mark.parametrize("T", [3, 5])  # 6 pairs: each thread plans for itself; 10: shared plan
def test_moe_experts_dot_path_equals_linear_per_expert(backend, rng, dtypes, T):
    """Few tokens per expert: the result equals linear -> swiglu -> linear on each selected
    expert (the same dot kernels and activation quantization), weighted and summed."""
    E, I, H, k = 6, 256, 256, 2
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    blocks = [Q.quantize((rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32), d)
              for s, d in zip(shapes, dtypes)]
    stacked = [backend.tensor_raw(b.reshape(-1), d, list(s)) for b, d, s in zip(blocks, dtypes, shapes)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, stacked, ids, w)

    def one_expert(t, e):
        g, u, dn = [backend.tensor_raw(b[e].reshape(-1), d, list(s[1:])) for b, d, s in zip(blocks, dtypes, shapes)]
        xt = backend.tensor(x[t:t + 1])
        gu, act, y = backend.empty("f32", [1, 2 * I]), backend.empty("f32", [1, I]), backend.empty("f32", [1, H])
        backend.linear(xt, g, None, gu)
        backend.linear(xt, u, None, gu, out_col=I)
        backend.swiglu(gu, act)
        backend.linear(act, dn, None, y)
        return y.numpy()[0].astype(np.float64)

    ref = np.stack([sum(w[t, j] * one_expert(t, ids[t, j]) for j in range(k)) for t in range(T)])
    assert R.nmse(got, ref) < F32_TOL


@pytest.mark.parametrize("dtypes", [("q8_0",) * 3, ("q4_k", "q4_k", "q6_k")])
def test_moe_experts_decode_batch_equals_each_token_alone(backend, rng, dtypes):
    """A stream recorded for a batch of decodes (decode_rows) keeps every expert on the dot
    path, even one chosen by all 12 tokens: each token's output is bit-identical to running it
    alone, so a sequence decodes the same in any batch."""
    E, I, H, k, T = 4, 256, 256, 2, 12
    tensors, _ = expert_weights(backend, rng, E, I, H, dtypes)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([[0, 1 + t % 3] for t in range(T)]).astype(np.int32)  # expert 0: every token
    w = rng.random((T, k)).astype(np.float32)

    def run(rows, decode_rows):
        return experts_on_stream(backend, x[rows], tensors, ids[rows], w[rows], decode_rows=decode_rows)

    alone = np.concatenate([run([t], 1) for t in range(T)])
    np.testing.assert_array_equal(run(list(range(T)), T), alone)
    # a prompt of the same tokens (no decode_rows) runs expert 0 on the batched dot kernel where
    # the types have one (bits as alone: tested below) and as sgemm otherwise: same values
    assert R.nmse(run(list(range(T)), 0), alone) < QUANT_DOT_TOL


@pytest.mark.parametrize("T", [4, 40])  # 8 pairs: each thread plans for itself; 80: shared plan
def test_moe_experts_prompt_batched_equals_each_token_alone(rng, T):
    """CPU: Q8_0 experts chosen by 2..64 tokens of a prompt run the batched dot kernel, which
    equals the one-token row kernel bit for bit: each token's output is the one it gets alone.
    (OpenCL runs a prompt's experts as grouped tiles, a one-token call as row dots: see below.)"""
    backend = _core.make_backend("cpu", 2)
    E, I, H, k = 4, 256, 512, 2
    tensors, values = expert_weights(backend, rng, E, I, H, ["q8_0"] * 3)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert counts.max() >= 2 and counts.max() <= 64 and (T < 10 or counts.min() > 8)
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, tensors, ids, w)
    alone = np.concatenate([run_experts(backend, x[t:t + 1], tensors, ids[t:t + 1], w[t:t + 1]) for t in range(T)])
    np.testing.assert_array_equal(got, alone)
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < QUANT_DOT_TOL


@pytest.mark.parametrize("dtypes,T,min_tokens", [(["q4_k", "q4_k", "q6_k"], 64, 8), (["q8_0"] * 3, 200, 64)])
def test_moe_experts_quantized_many_tokens_per_expert_is_f32_exact(backend, rng, dtypes, T, min_tokens):
    """Every expert here is chosen by more tokens than the dot path takes (8; 64 for types with
    a batched dot kernel), so each runs dequantize + sgemm: no activation quantization, f32
    accuracy against the dequantized weights."""
    E, I, H, k = 4, 256, 256, 2
    tensors, values = expert_weights(backend, rng, E, I, H, dtypes)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    assert np.bincount(ids.ravel(), minlength=E).min() > min_tokens
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, tensors, ids, w)
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < F32_TOL


@pytest.mark.parametrize("dtypes", [("q8_0",) * 3, ("q4_k", "q4_k", "q6_k")])
def test_moe_experts_float_activations_one_token_as_exact_as_many(backend, rng, dtypes):
    """A scoring stream (float_activations) keeps f32 activations for every expert, whatever the
    token or pair count: a token alone is as close to the f32 reference as the tokens of a
    many-token call, whose experts are each chosen by few enough tokens for the dot path."""
    E, I, H, k, T = 4, 256, 256, 2, 6
    tensors, values = expert_weights(backend, rng, E, I, H, dtypes)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    ref = R.moe_experts(x, *values, ids, w)

    assert R.nmse(experts_on_stream(backend, x, tensors, ids, w, float_activations=True), ref) < F32_TOL
    for t in range(T):
        alone = experts_on_stream(backend, x[t:t + 1], tensors, ids[t:t + 1], w[t:t + 1], float_activations=True)
        assert R.nmse(alone[0], ref[t]) < F32_TOL


def test_moe_experts_ids_out_of_range_add_nothing(backend, rng):
    E, I, H, k, T = 6, 24, 40, 3, 4
    tensors, values = expert_weights(backend, rng, E, I, H, ["f32"] * 3)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.array([[0, -1, 2], [6, 5, 5], [-7, 100, 1], [-1, -1, -1]], np.int32)
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(backend, x, tensors, ids, w)
    assert np.all(got[3] == 0)
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < F32_TOL


def test_moe_stream_replay_follows_new_routing(backend, rng):
    """Routing is read at submit time: one recorded stream, new logits every submit."""
    E, I, H, k, T = 16, 32, 64, 2, 12
    tensors, values = expert_weights(backend, rng, E, I, H, ["q8_0"] * 3)
    router = rng.standard_normal((E, H)).astype(np.float32)
    X = backend.empty("f32", [T, H])
    logits, ids, w = backend.empty("f32", [T, E]), backend.empty("i32", [T, k]), backend.empty("f32", [T, k])
    out = backend.empty("f32", [T, H])
    s = backend.stream()
    backend.linear(X, backend.tensor(router), None, logits, stream=s)
    backend.moe_route(logits, k, True, ids, w, stream=s)
    backend.moe_experts(X, *tensors, ids, w, out, stream=s)
    seen = set()
    for _ in range(3):
        x = rng.standard_normal((T, H)).astype(np.float32)
        X.upload(x)
        s.submit()
        s.sync()
        ref_ids, ref_w = R.moe_route(x @ router.T, k, True)
        np.testing.assert_array_equal(ids.numpy(), ref_ids)
        assert R.nmse(out.numpy(), R.moe_experts(x, *values, ref_ids, ref_w)) < QUANT_DOT_TOL
        seen.add(ref_ids.tobytes())
    assert len(seen) == 3


def test_moe_supports(backend):
    for dtype in ("f32", "f16", "bf16", "q8_0", "q4_k", "q6_k"):
        assert backend.supports("moe_experts", dtype)
    assert backend.supports("moe_route")


@pytest.mark.parametrize("call", [
    # top_k out of range, ids / weights of the wrong shape or dtype
    lambda be: be.moe_route(be.empty("f32", [2, 8]), 9, True, be.empty("i32", [2, 9]), be.empty("f32", [2, 9])),
    lambda be: be.moe_route(be.empty("f32", [2, 8]), 0, True, be.empty("i32", [2, 0]), be.empty("f32", [2, 0])),
    lambda be: be.moe_route(be.empty("f32", [2, 8]), 2, True, be.empty("i32", [3, 2]), be.empty("f32", [3, 2])),
    lambda be: be.moe_route(be.empty("f32", [2, 8]), 2, True, be.empty("f32", [2, 2]), be.empty("f32", [2, 2])),
    # experts: 2-D weights, gate/up disagree, down transposed, x/out mismatch, ids rows
    lambda be: be.moe_experts(be.empty("f32", [2, 32]), be.empty("f32", [4, 32]), be.empty("f32", [4, 32]),
                              be.empty("f32", [32, 4]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                              be.empty("f32", [2, 32])),
    lambda be: be.moe_experts(be.empty("f32", [2, 32]), be.empty("f32", [4, 8, 32]), be.empty("f32", [4, 9, 32]),
                              be.empty("f32", [4, 32, 8]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                              be.empty("f32", [2, 32])),
    lambda be: be.moe_experts(be.empty("f32", [2, 32]), be.empty("f32", [4, 8, 32]), be.empty("f32", [4, 8, 32]),
                              be.empty("f32", [4, 8, 32]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                              be.empty("f32", [2, 32])),
    lambda be: be.moe_experts(be.empty("f32", [2, 32]), be.empty("f32", [4, 8, 32]), be.empty("f32", [4, 8, 32]),
                              be.empty("f32", [4, 32, 8]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                              be.empty("f32", [3, 32])),
    lambda be: be.moe_experts(be.empty("f32", [2, 32]), be.empty("f32", [4, 8, 32]), be.empty("f32", [4, 8, 32]),
                              be.empty("f32", [4, 32, 8]), be.empty("i32", [3, 1]), be.empty("f32", [3, 1]),
                              be.empty("f32", [2, 32])),
    # group offsets: of another expert count, of the wrong outputs, block groups not one per 32 inputs
    *[lambda be, o=o: be.moe_experts(be.empty("f32", [2, 64]), be.empty("f32", [4, 8, 64]), be.empty("f32", [4, 8, 64]),
                                     be.empty("f32", [4, 64, 8]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                                     be.empty("f32", [2, 64]), offsets=o(be))
      for o in (lambda be: {"gate": (be.empty("f32", [3, 1, 8]), be.empty("i32", [2]))},
                lambda be: {"down": (be.empty("f32", [4, 1, 8]), be.empty("i32", [1]))},
                lambda be: {"up": (be.empty("f32", [4, 1, 8]), be.empty("i32", [1]))})],
    # input orders of another expert count or input width
    *[lambda be, o=o: be.moe_experts(be.empty("f32", [2, 64]), be.empty("f32", [4, 8, 64]), be.empty("f32", [4, 8, 64]),
                                     be.empty("f32", [4, 64, 8]), be.empty("i32", [2, 1]), be.empty("f32", [2, 1]),
                                     be.empty("f32", [2, 64]), input_orders=o(be))
      for o in (lambda be: {"gate_up": be.empty("i32", [3, 64])}, lambda be: {"down": be.empty("i32", [4, 64])})],
])
def test_moe_bad_shapes_raise_value_error(backend, call):
    with pytest.raises(ValueError):
        call(backend)


def test_moe_experts_out_aliasing_x_is_rejected(backend):
    x = backend.empty("f32", [2, 32])
    w = [backend.empty("f32", [4, 8, 32]), backend.empty("f32", [4, 8, 32]), backend.empty("f32", [4, 32, 8])]
    with pytest.raises(ValueError, match="alias"):
        backend.moe_experts(x, *w, backend.empty("i32", [2, 1]), backend.empty("f32", [2, 1]), x)
