"""What only the OpenCL backend has: device specs, tensors split over several device buffers, the
program binary cache, launch profiling, a prompt's experts grouped on the device, and its
bad-input errors; for both kernel families where they differ (`ocl` is each in turn)."""
import numpy as np
import pytest

import reference as R
from ferrum import _core
from test_moe_ops import expert_weights, run_experts, uneven_ids
from test_ops import rope_query_heads


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def ocl(request):
    return _core.make_backend("opencl", opencl_kernels=request.param)


def family(be):
    return _core.opencl.device_info(be)["kernels"]


def test_device_specs_by_index_and_name(ocl):
    info = _core.opencl.device_info(ocl)
    platform_word = info["platform"].split()[0].upper()  # case-insensitive substring
    device_word = info["device"].split("-")[0].lower()
    for spec in ("opencl", "opencl:0", "opencl:0:0", f"opencl:{platform_word}",
                 f"opencl:{platform_word}:{device_word}", f"opencl:0:{device_word}"):
        be = _core.make_backend(spec)
        assert be.name == "opencl" and _core.opencl.device_info(be)["device"] == info["device"]


@pytest.mark.parametrize("spec,message", [
    ("opencl:7", "no OpenCL platform matches '7'"),
    ("opencl:no-such-platform", "no OpenCL platform matches"),
    ("opencl:0:5", "no OpenCL device matches '5'"),
    ("opencl:0:no-such-device", "no OpenCL device matches"),
    ("opencl:", "bad OpenCL device spec"),
    ("opencl:0:0:0", "bad OpenCL device spec"),
    ("opencl::0", "bad OpenCL device spec"),
    ("openclx", "unknown device"),
])
def test_bad_device_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        _core.make_backend(spec)


def test_bad_max_alloc_override(monkeypatch):
    monkeypatch.setenv("FERRUM_OPENCL_MAX_ALLOC_BYTES", "lots")
    with pytest.raises(ValueError, match="FERRUM_OPENCL_MAX_ALLOC_BYTES"):
        _core.make_backend("opencl")


@pytest.fixture
def small_alloc(ocl, monkeypatch):
    """A backend of ocl's kernel family whose buffers hold at most 16 KiB, so ordinary tensors are
    split."""
    monkeypatch.setenv("FERRUM_OPENCL_MAX_ALLOC_BYTES", str(16 << 10))
    be = _core.make_backend("opencl", opencl_kernels=family(ocl))
    assert _core.opencl.device_info(be)["max_alloc_bytes"] == 16 << 10
    return be


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_k", "q6_k"])
def test_split_weights_linear_and_embedding(ocl, small_alloc, rng, dtype):
    n, k = 301, 512  # f32: 602 KiB over 38 buffers; q4_k: 85 KiB over 6
    w = rng.standard_normal((n, k)).astype(np.float32)
    if dtype in ("f32", "f16"):
        raw = w.astype(np.float16) if dtype == "f16" else w
        put = lambda be: be.tensor(raw)
    else:
        raw = np.concatenate([_core.quant.quantize(dtype, r) for r in w])
        put = lambda be: be.tensor_raw(raw, dtype, [n, k])
    x = rng.standard_normal((3, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    ids = np.array([0, 300, 77, 150, -3, 299, 301], np.int32)
    results = []
    for be in (ocl, small_alloc):
        W = put(be)
        out = be.empty("f32", [3, n + 2])
        be.linear(be.tensor(x), W, be.tensor(bias), out, out_col=2)
        emb = be.empty("f32", [len(ids), k])
        be.embedding(be.tensor(ids), W, emb)
        back = W.numpy()
        results.append((out.numpy()[:, 2:], emb.numpy(), back))
    assert raw.nbytes > 16 << 10
    (o1, e1, b1), (o2, e2, b2) = results
    assert R.nmse(o2, o1) < 1e-12
    np.testing.assert_array_equal(e2, e1)
    np.testing.assert_array_equal(b2.view(np.uint8), b1.view(np.uint8))  # split upload / download


def test_split_tensor_outside_weights_is_a_clear_error(small_alloc):
    x = small_alloc.tensor(np.ones((64, 128), np.float32))  # 32 KiB: two buffers
    with pytest.raises(ValueError, match="spans several device buffers"):
        small_alloc.rms_norm(x, small_alloc.tensor(np.ones(128, np.float32)), 1e-5, small_alloc.empty("f32", [64, 128]))
    # a view inside one buffer is fine
    out = small_alloc.empty("f32", [4, 128])
    small_alloc.rms_norm(x.slice(0, 4), small_alloc.tensor(np.ones(128, np.float32)), 1e-5, out)
    np.testing.assert_allclose(out.numpy(), 1.0, rtol=1e-5)


def test_row_larger_than_max_alloc_is_memory_error(small_alloc):
    with pytest.raises(MemoryError, match="exceeds the OpenCL device's maximum allocation"):
        small_alloc.empty("f32", [2, 8192])  # 32 KiB rows


def test_huge_allocation_is_memory_error(ocl):
    with pytest.raises(MemoryError):
        ocl.empty("f32", [1 << 20, 1 << 20])  # 4 TiB


def test_allocations_past_the_device_memory_are_memory_error(ocl):
    """Buffers are counted against the device's global memory when allocated (drivers that back
    them lazily, NVIDIA's, would only fail at first use, mid-step): a second 60% of it fails,
    and fits again once the first is freed. Nothing is written, so no memory is touched."""
    mem = _core.opencl.device_info(ocl)["global_mem_bytes"]
    rows = int(mem * 0.6) >> 20
    first = ocl.empty("i8", [rows, 1 << 20])
    with pytest.raises(MemoryError, match="in use; cannot allocate"):
        ocl.empty("i8", [rows, 1 << 20])
    del first
    assert ocl.empty("i8", [rows, 1 << 20]).shape == [rows, 1 << 20]


def test_program_binary_cache(monkeypatch, tmp_path, rng):
    """A fresh cache directory: the first backend compiles, a second one loads the binary."""
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path))
    a = rng.standard_normal((3, 100)).astype(np.float32)
    idx = np.array([2, 0], np.int32)
    for expect_built in (True, False):
        be = _core.make_backend("opencl")
        out = be.empty("f32", [2, 100])
        be.gather_rows(be.tensor(a), be.tensor(idx), out)
        np.testing.assert_array_equal(out.numpy(), a[idx])
        info = _core.opencl.device_info(be)
        assert (info["programs_built"], info["programs_from_cache"]) == ((1, 0) if expect_built else (0, 1))
    assert len(list((tmp_path / "opencl").glob("*.bin"))) == 1


def test_profiling_reports_each_launch(ocl, rng):
    x = ocl.tensor(rng.standard_normal((2, 64)).astype(np.float32))
    w = ocl.tensor(rng.standard_normal((64, 64)).astype(np.float32))
    h, out = ocl.empty("f32", [2, 64]), ocl.empty("f32", [2, 64])
    s = ocl.stream()
    ocl.rms_norm(x, ocl.tensor(np.ones(64, np.float32)), 1e-5, h, stream=s)
    ocl.linear(h, w, None, out, stream=s)
    ocl.gather_rows(out, ocl.tensor(np.array([1, 0], np.int32)), h, stream=s)
    _core.opencl.set_profiling(s, True)
    s.submit()
    s.submit()
    times = _core.opencl.kernel_times(s)
    launches = {"cpu": ["rms_norm", "linear_t4", "gather_rows"], "gpu": ["norm_rows", "gemv_f32_tn", "gather_rows"]}
    assert [name for name, _ in times] == launches[family(ocl)] * 2
    assert all(ns > 0 for _, ns in times)
    assert _core.opencl.kernel_times(s) == []  # reported once


def test_tensors_of_another_backend_are_rejected(ocl):
    cpu = _core.make_backend("cpu", 1)
    with pytest.raises(ValueError, match="not an OpenCL tensor"):
        ocl.swiglu(cpu.tensor(np.ones((1, 8), np.float32)), ocl.empty("f32", [1, 4]))
    with pytest.raises(ValueError, match="stream of another backend"):
        ocl.swiglu(ocl.tensor(np.ones((1, 8), np.float32)), ocl.empty("f32", [1, 4]), stream=cpu.stream())
    with pytest.raises(ValueError, match="not an OpenCL"):
        _core.opencl.device_info(cpu)


def test_head_dim_beyond_kernel_limit(ocl):
    hd = 512
    x = np.zeros((1, 1, hd), np.float32)
    cos = np.ones((4, hd // 2), np.float32)
    with pytest.raises(ValueError, match="head_dim 512 exceeds"):
        rope_query_heads(ocl, x, [0], cos, cos, "half_split")


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
# A row dot per pair (each expert tensor: 512 KiB f32 ... 72 KiB q4_0), and a prompt grouped by
# expert into tiles (two experts, 8 pairs each; 128 KiB f32 ... 18 KiB q4_0, split inside expert 1;
# activations stay under the 16 KiB buffers).
@pytest.mark.parametrize("T,E,H,I", [(3, 8, 512, 32), (8, 2, 256, 64)])
def test_split_expert_weights_moe(ocl, small_alloc, rng, dtype, T, E, H, I):
    """Expert tensors over several buffers (split inside an expert, by rows): the same result as
    unsplit, every row dotted by the same kernel."""
    k = 2
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    ws = [(rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for s in shapes]
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(-1, E + 1, (T, k)).astype(np.int32)  # some out of range
    ids[0] = [E - 1, 0]
    wts = rng.random((T, k)).astype(np.float32)

    def put(be, w):
        if dtype == "f32":
            return be.tensor(w)
        if dtype == "f16":
            return be.tensor(w.astype(np.float16))
        raw = np.concatenate([_core.quant.quantize(dtype, r) for r in w.reshape(-1, w.shape[-1])])
        return be.tensor_raw(raw, dtype, list(w.shape))

    results = []
    for be in (ocl, small_alloc):
        out = be.empty("f32", [T, H])
        be.moe_experts(be.tensor(x), *[put(be, w) for w in ws], be.tensor(ids), be.tensor(wts), out)
        results.append(out.numpy())
    np.testing.assert_array_equal(results[1], results[0])
    assert np.abs(results[0]).max() > 0


@pytest.mark.parametrize("T,E,decode_rows,grouped", [(8, 2, 0, True), (20, 4, 0, True), (40, 4, 0, True),
                                                     (3, 8, 0, False), (40, 4, 40, False)])
def test_moe_prompt_is_grouped_by_expert(ocl, rng, T, E, decode_rows, grouped):
    """A prompt with 8 or more (token, expert) pairs per expert runs each matrix as one launch of
    tiles over the pairs grouped by expert (the shapes the tests here use); fewer pairs, or a
    batch of decodes (each token must get what it gets alone), run a row dot per pair (over
    8-bit activations, as linear's decodes). Names per kernel family."""
    k, H, I = 2, 64, 32
    tensors, _ = expert_weights(ocl, rng, E, I, H, ["q8_0"] * 3)
    s = ocl.stream()
    s.decode_rows = decode_rows
    _core.opencl.set_profiling(s, True)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    ocl.moe_experts(ocl.tensor(rng.standard_normal((T, H)).astype(np.float32)), *tensors, ocl.tensor(ids),
                    ocl.tensor(rng.random((T, k)).astype(np.float32)), ocl.empty("f32", [T, H]), stream=s)
    s.submit()
    s.sync()
    names = [n for n, _ in _core.opencl.kernel_times(s)]
    if grouped:
        tiles, swiglu = ("moe_tiles_t4", "swiglu") if family(ocl) == "cpu" else ("moe_gemm", "swiglu_rows")
        assert names == ["moe_group", tiles, tiles, swiglu, tiles, "moe_combine"]
    elif family(ocl) == "cpu":
        # x quantized to 8 bits once for gate and up, the SwiGLU output once for down
        assert names == ["quantize_q8_rows", "moe_rows_q8", "moe_rows_q8", "swiglu", "quantize_q8_rows",
                         "moe_rows_q8", "moe_combine"]
    else:  # the SwiGLU kernel quantizes its output for down itself
        assert names == ["quantize_q8_rows", "moe_gemv_q8", "moe_gemv_q8", "swiglu_rows", "moe_gemv_q8",
                         "moe_combine"]


@pytest.mark.parametrize("dtypes", [("q8_0",) * 3, ("q4_0", "q4_0", "q6_k"), ("f16", "q5_1", "q4_k")])
def test_moe_prompt_token_does_not_depend_on_the_rest(ocl, rng, dtypes):
    """A prompt token's output is the same, bit for bit, whatever other tokens share its experts:
    the first and second halves of a prompt run as prompts of their own give the rows of the
    whole: all three run as tiles of the pairs grouped by expert, different tiles each time (the
    tile heights differ per weight type, so q4_0 / q6_k makes two groupings). Activations stay
    f32, so the result has f32 accuracy against float64 over the dequantized experts."""
    E, I, H, k, T = 4, 256, 256, 2, 40  # 20 tokens: 10 pairs per expert, enough to group
    tensors, values = expert_weights(ocl, rng, E, I, H, dtypes)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = uneven_ids(rng, T, k, E)  # expert 3 unused
    w = rng.random((T, k)).astype(np.float32)
    got = run_experts(ocl, x, tensors, ids, w)
    halves = [run_experts(ocl, x[h], tensors, ids[h], w[h]) for h in (slice(0, T // 2), slice(T // 2, T))]
    np.testing.assert_array_equal(got, np.concatenate(halves))
    assert R.nmse(got, R.moe_experts(x, *values, ids, w)) < 1e-10


def test_the_cpu_backend_rejects_opencl_tensors(ocl):
    cpu = _core.make_backend("cpu", 1)
    x, w = ocl.tensor(np.ones((2, 4), np.float32)), cpu.tensor(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="belongs to another backend"):
        cpu.swiglu(x, cpu.empty("f32", [2, 2]))
    with pytest.raises(ValueError, match="belongs to another backend"):
        cpu.linear(x, w, None, cpu.empty("f32", [2, 3]))
    with pytest.raises(ValueError, match="belongs to another backend"):
        cpu.rms_norm(cpu.tensor(np.ones((2, 4), np.float32)), ocl.tensor(np.ones(4, np.float32)), 1e-5,
                     cpu.empty("f32", [2, 4]))
