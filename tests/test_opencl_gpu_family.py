"""The OpenCL backend's gpu kernel family, run on pocl: how a family is chosen, and what only the
gpu family does (its results against the CPU backend are in test_opencl_parity.py, for both
families): weights repacked into flat rows, matmuls taking their 8-bit activations from the norm
or SwiGLU launch before them, command-buffer replay, decode attention split over the positions."""
import numpy as np
import pytest

import ferrum
import reference as R
from ferrum import _core
from test_ops import linear_on_stream
from test_opencl_models import lora_setup  # noqa: F401 (a fixture)
from test_opencl_parity import encode_weight, upload_weight

# The types whose GGUF blocks leave the quants less than 16-byte aligned: pack_weight repacks them.
FLAT_DTYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q6_k", "iq4_xs"]


@pytest.fixture(scope="module")
def gpu():
    return _core.make_backend("opencl", opencl_kernels="gpu")


def names(stream):
    return [n for n, _ in _core.opencl.kernel_times(stream)]


def test_family_by_device_type_environment_and_option(monkeypatch):
    monkeypatch.delenv("FERRUM_OPENCL_KERNELS", raising=False)
    info = _core.opencl.device_info(_core.make_backend("opencl"))
    assert info["kernels"] == ("gpu" if info["gpu"] else "cpu")
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", "gpu")
    assert _core.opencl.device_info(_core.make_backend("opencl"))["kernels"] == "gpu"
    assert _core.opencl.device_info(_core.make_backend("opencl", opencl_kernels="cpu"))["kernels"] == "cpu"
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", "tpu")
    with pytest.raises(ValueError, match="FERRUM_OPENCL_KERNELS"):
        _core.make_backend("opencl")
    with pytest.raises(ValueError, match="opencl_kernels"):
        _core.make_backend("opencl", opencl_kernels="fast")


@pytest.mark.parametrize("dtype", FLAT_DTYPES)
def test_flat_rows_give_the_same_bits(gpu, rng, dtype, monkeypatch):
    """pack_weight repacks a weight in place (quants first, then headers, per row); decodes,
    short and long prompts and embedding rows read it to the same bits as the GGUF rows, in one
    device buffer or split over several."""
    K = 1024 if dtype.endswith("_k") or dtype == "iq4_xs" else 512  # rows of a multiple of 8 bytes
    N = 800  # > 192 KiB of weights: several buffers under the cap below, activations in one
    raw, _ = encode_weight(rng.standard_normal((N, K)).astype(np.float32), dtype)
    x = rng.standard_normal((40, K)).astype(np.float32)
    ids = np.array([0, 799, 7, 333], np.int32)
    monkeypatch.setenv("FERRUM_OPENCL_MAX_ALLOC_BYTES", str(192 << 10))
    split = _core.make_backend("opencl", opencl_kernels="gpu")

    def run(be, w):
        outs = []
        for T in (1, 3, 40):
            out = be.empty("f32", [T, N])
            be.linear(be.tensor(x[:T]), w, None, out)
            outs.append(out.numpy())
        emb = be.empty("f32", [len(ids), K])
        be.embedding(be.tensor(ids), w, emb)
        return outs + [emb.numpy()]

    expect = run(gpu, upload_weight(gpu, raw, dtype, (N, K)))
    for be in (gpu, split):
        packed = be.pack_weight(upload_weight(be, raw, dtype, (N, K)))
        assert packed.numpy().tobytes() != np.asarray(raw).tobytes()  # really repacked
        for got, want in zip(run(be, packed), expect):
            np.testing.assert_array_equal(got, want)


def test_float_and_aligned_weights_are_not_repacked(gpu, rng):
    for dtype in ("f32", "q4_k"):
        raw, _ = encode_weight(rng.standard_normal((8, 256)).astype(np.float32), dtype)
        w = upload_weight(gpu, raw, dtype, (8, 256))
        np.testing.assert_array_equal(gpu.pack_weight(w).numpy().view(np.uint8), w.numpy().view(np.uint8))


def decode_layer(be, rng, streams):
    """add_rms_norm -> two projections of its output (q4_0 and q6_k, one fused output), SwiGLU ->
    a q8_0 projection, as one decode (T = 1) records them; streams(i) is the stream of op i.
    Returns the outputs and the residual."""
    H, I = 256, 128
    x, res = (rng.standard_normal((1, H)).astype(np.float32) for _ in range(2))
    gu = rng.standard_normal((1, 2 * I)).astype(np.float32)
    wa, wb, wd = (upload_weight(be, encode_weight(rng.standard_normal(shape).astype(np.float32), dt)[0], dt, shape)
                  for dt, shape in (("q4_0", (40, H)), ("q6_k", (24, H)), ("q8_0", (H, I))))
    r, h, qkv = be.tensor(res), be.empty("f32", [1, H]), be.empty("f32", [1, 64])
    act, down = be.empty("f32", [1, I]), be.empty("f32", [1, H])
    be.add_rms_norm(r, be.tensor(x), be.tensor(np.ones(H, np.float32)), 1e-6, h, stream=streams(0))
    be.linear(h, wa, None, qkv, stream=streams(1))
    be.linear(h, wb, None, qkv, out_col=40, stream=streams(2))
    be.swiglu(be.tensor(gu), act, stream=streams(3))
    be.linear(act, wd, None, down, stream=streams(4))
    return lambda: [t.numpy() for t in (qkv, down, r, h, act)]


def test_matmuls_take_8_bit_activations_from_the_launch_before(gpu):
    """In one stream the norm quantizes its output for both projections that read it and the
    SwiGLU its own for down: no quantize launches, and the same bits as each op in a stream of its
    own (where every matmul quantizes x itself)."""
    s = gpu.stream()
    fused = decode_layer(gpu, np.random.default_rng(3), lambda i: s)
    _core.opencl.set_profiling(s, True)
    s.submit()
    s.sync()
    assert names(s) == ["norm_rows", "gemv_q8_t1", "gemv_q8_t1", "swiglu_rows", "gemv_q8_t1"]
    alone = []
    separate = decode_layer(gpu, np.random.default_rng(3), lambda i: alone.append(gpu.stream()) or alone[-1])
    for st in alone:
        _core.opencl.set_profiling(st, True)
        st.submit()
        st.sync()
    assert names(alone[1]) == ["quantize_q8_rows", "gemv_q8_t1"]
    for a, b in zip(fused(), separate()):
        np.testing.assert_array_equal(a, b)


def test_command_buffer_replays_the_recorded_step(gpu, rng):
    """A recorded stream replays through a command buffer where the device has one (pocl does):
    after the inputs are rewritten, a replay gives what enqueueing each launch gives."""
    K, N = 256, 48
    raw, _ = encode_weight(rng.standard_normal((N, K)).astype(np.float32), "q8_0")
    w = upload_weight(gpu, raw, "q8_0", (N, K))
    x, h, out = gpu.empty("f32", [1, K]), gpu.empty("f32", [1, K]), gpu.empty("f32", [1, N])
    s = gpu.stream()
    gpu.rms_norm(x, gpu.tensor(np.ones(K, np.float32)), 1e-6, h, stream=s)
    gpu.linear(h, w, None, out, stream=s)
    assert _core.opencl.uses_command_buffer(s) == _core.opencl.device_info(gpu)["command_buffer"]
    results = {}
    for replay in (True, False):
        _core.opencl.set_command_buffer(s, replay)
        got = []
        for seed in range(3):
            x.upload(np.random.default_rng(seed).standard_normal((1, K)).astype(np.float32))
            s.submit()
            s.sync()
            got.append(out.numpy())
        results[replay] = got
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(results[True][0], results[True][1])


@pytest.mark.parametrize("T,launches", [(2, ["qkv_rope_cache", "attention_split", "attention_combine"]),
                                         (40, ["qkv_rope_cache", "attention_split"])])
def test_decodes_split_the_positions(gpu, T, launches):
    """Steps of up to 16 tokens over a pool of more than 256 positions per sequence split each
    token's positions over work-groups and combine them (results: test_opencl_parity.py's long
    context test); longer steps run a work-group per token and head group."""
    H, KV, hd, bs, max_blocks = 4, 2, 32, 16, 24
    kv = _core.KvLayer(gpu.empty("f32", [max_blocks, KV, bs, hd]), gpu.empty("f32", [max_blocks, KV, bs, hd]))
    cos, sin = R.rope_tables(max_blocks * bs, hd, 1e4)
    rope = _core.RopeTable(gpu.tensor(cos.astype(np.float32)), gpu.tensor(sin.astype(np.float32)),
                           _core.RopeLayout.half_split)
    pos = np.arange(300, 300 + T, dtype=np.int32)
    batch = _core.AttnBatch(gpu.tensor(np.zeros(T, np.int32)), gpu.tensor(pos), gpu.tensor(pos),
                            gpu.tensor(np.arange(max_blocks, dtype=np.int32)[None]))
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), 0)
    q, out = gpu.empty("f32", [T, H, hd]), gpu.empty("f32", [T, H, hd])
    s = gpu.stream()
    gpu.qkv_to_cache(gpu.tensor(np.ones((T, (H + 2 * KV) * hd), np.float32)), None, None, 1e-6, rope, batch,
                     params, q, kv, stream=s)
    gpu.paged_attention(q, kv, batch, params, out, stream=s)
    _core.opencl.set_profiling(s, True)
    s.submit()
    s.sync()
    assert names(s) == launches


@pytest.mark.parametrize("T,launches", [(2, ["attention_split", "attention_combine", "gemv_q8_tn"]),
                                        (20, ["attention_split", "gemv_q8_tn"])])
def test_o_projection_takes_8_bit_activations_from_attention(gpu, T, launches):
    """A batch of decodes: the attention kernel that writes the output (the combine of the
    splits, or the single pass) quantizes it for the o projection; the same bits as quantizing
    it in a launch of its own."""
    H, KV, hd, bs, max_blocks = 4, 2, 32, 16, 24
    rng = np.random.default_rng(4)
    pool = rng.standard_normal((max_blocks, KV, bs, hd)).astype(np.float32)
    kv = _core.KvLayer(gpu.tensor(pool), gpu.tensor(pool[::-1].copy()))
    pos = np.arange(300, 300 + T, dtype=np.int32)
    batch = _core.AttnBatch(gpu.tensor(np.zeros(T, np.int32)), gpu.tensor(pos), gpu.tensor(pos),
                            gpu.tensor(np.arange(max_blocks, dtype=np.int32)[None]))
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), 0)
    q = gpu.tensor(rng.standard_normal((T, H, hd)).astype(np.float32))
    wo = upload_weight(gpu, encode_weight(rng.standard_normal((48, H * hd)).astype(np.float32), "q4_0")[0], "q4_0",
                       (48, H * hd))

    def run(one_stream):
        attn, out = gpu.empty("f32", [T, H, hd]), gpu.empty("f32", [T, 48])
        streams = [gpu.stream() for _ in range(1 if one_stream else 2)]
        for st in streams:
            st.decode_rows = T
            _core.opencl.set_profiling(st, True)
        gpu.paged_attention(q, kv, batch, params, attn, stream=streams[0])
        gpu.linear(attn.reshape([T, H * hd]), wo, None, out, stream=streams[-1])
        for st in streams:
            st.submit()
            st.sync()
        return out.numpy(), sum((names(st) for st in streams), [])

    fused, fused_names = run(True)
    alone, alone_names = run(False)
    assert fused_names == launches and alone_names == launches[:-1] + ["quantize_q8_rows", launches[-1]]
    np.testing.assert_array_equal(fused, alone)


@pytest.mark.parametrize("dtype", ["q4_0", "q4_k", "q6_k", "q8_0", "f16"])
def test_portable_forms_equal_the_device_ones(gpu, rng, dtype, monkeypatch):
    """The gpu family's portable OpenCL C (FERRUM_OPENCL_PORTABLE=1) gives the bits of the forms a
    device builds (on NVIDIA: warp shuffles and dp4a as inline PTX; elsewhere the same code): a
    decode, a batch of decodes, a scoring row and a short prompt."""
    monkeypatch.setenv("FERRUM_OPENCL_PORTABLE", "1")
    portable = _core.make_backend("opencl", opencl_kernels="gpu")
    assert "NV_ASM" not in _core.opencl.device_info(portable)["gpu_defines"]
    K, N = 512, 72
    raw, _ = encode_weight(rng.standard_normal((N, K)).astype(np.float32), dtype)
    x = rng.standard_normal((3, K)).astype(np.float32)
    for rows, decode_rows, scoring in ((x[:1], 0, False), (x, 3, False), (x[:1], 0, True), (x, 0, False)):
        outs = [linear_on_stream(be, rows, be.pack_weight(upload_weight(be, raw, dtype, (N, K))), N, decode_rows, scoring)
                for be in (portable, gpu)]
        np.testing.assert_array_equal(outs[0], outs[1])


# Every size of the gpu family changed (kernels/gpu_common.cl lists them): smaller lane groups,
# more rows per group, two query heads per attention work-group (4 per KV head here), 64-position
# splits, narrower tiles.
OTHER_SIZES = ("LANES=16,GEMV_GROUPS=2,GEMV_ROWS=3,GEMV_TOKENS=4,GEMM_TM=32,GEMM_TN=48,GEMM_TK=64,GEMM_WM=2,"
               "GEMM_WN=3,ATTN_WG=32,MAX_GROUP=2,ATTN_SPLIT=64,ATTN_SPLIT_TOKENS=8,ROW_WG=64")


def test_other_sizes_give_the_same_results(rng, monkeypatch):
    """The kernels hold for any sizes a tuning run may pick: linear (decode, batch of decodes,
    short and long prompt), embedding, attention over split and unsplit positions, experts, all
    against float64 references / the CPU backend, with the sizes above."""
    from test_opencl_parity import attention_step, moe_parity, opencl_moe_bound, q8_0_round_trip
    monkeypatch.setenv("FERRUM_OPENCL_GPU_TUNING", OTHER_SIZES)
    be = _core.make_backend("opencl", opencl_kernels="gpu")
    assert "-DLANES=16 " in _core.opencl.device_info(be)["gpu_defines"]
    cpu = _core.make_backend("cpu", 2)
    for dtype in ("q4_0", "q4_k", "q6_k", "f16"):
        K, N = 512, 61
        raw, wref = encode_weight(rng.standard_normal((N, K)).astype(np.float32), dtype)
        w = be.pack_weight(upload_weight(be, raw, dtype, (N, K)))
        x = rng.standard_normal((40, K)).astype(np.float32)
        for rows, decode_rows in ((1, 0), (5, 5), (3, 0), (40, 0)):
            xs = q8_0_round_trip(x[:rows]) if (decode_rows or rows == 1) and dtype != "f16" else x[:rows]
            got = linear_on_stream(be, x[:rows], w, N, decode_rows)
            assert R.nmse(got, xs.astype(np.float64) @ wref.T) < 1e-10, (dtype, rows)
        emb = be.empty("f32", [2, K])
        be.embedding(be.tensor(np.array([3, 60], np.int32)), w, emb)
        np.testing.assert_array_equal(emb.numpy(), wref[[3, 60]].astype(np.float32))
    for args in (dict(), dict(seq_lens=(300, 70, 9), new=(1, 1, 1), max_blocks=24)):
        (cq, co, ck, cv), (q, o, k, v) = (attention_step(b, 3, "f32", 8, 2, 64, 0, True, "half_split", **args)
                                          for b in (cpu, be))
        assert R.nmse(q[:-2], cq[:-2]) < 1e-7 and R.nmse(o[:-2], co[:-2]) < 1e-7  # two padding rows
        assert R.nmse(k, ck) < 1e-7 and R.nmse(v, cv) < 1e-7
    for T in (3, 40):
        _, got, ref = moe_parity(cpu, be, rng, ["q8_0"] * 3, T, E=4)
        assert R.nmse(got, ref) < opencl_moe_bound(["q8_0"] * 3, T, E=4)


def test_lora_at_other_sizes(lora_setup, monkeypatch):
    """LoRA's lane-group shrink at the sizes above: a step mixing adapters (one kept in f16, one
    also at another request scale) and the base within the parity bound of the CPU backend's,
    each row as it scores alone."""
    from test_lora import PROMPT as LORA_PROMPT
    from test_opencl_models import lora_llm, lora_request
    monkeypatch.setenv("FERRUM_OPENCL_GPU_TUNING", OTHER_SIZES)
    base, adapters = lora_setup
    cpu = lora_llm(base, "cpu", None)
    ocl = ferrum.LLM(str(base), device="opencl", kv_dtype="f32", num_threads=2, kv_cache_tokens=1024, enable_lora=True,
                     max_loras=4, max_lora_rank=8, enable_prefix_caching=False)
    names = ["llama-rank-pattern", None, "llama-r1-qv", "llama-all-linear", "llama-r8-f16", "llama-r1-qv"]
    reqs = [lora_request(adapters, n, s) for n, s in zip(names, [1, 1, 1, 1, 1, -0.5])]
    prompts = [LORA_PROMPT[i:] + LORA_PROMPT[:i] for i in range(len(names))]
    for p, r, got in zip(prompts, reqs, ocl.score(prompts, lora_request=reqs)):
        ref = cpu.score(p, lora_request=r)
        assert np.abs(got - ref).max() < 1e-4 * max(np.abs(ref).max(), 1.0)
        assert np.array_equal(got, ocl.score(p, lora_request=r))


def test_bad_tuning_overrides_are_value_errors(monkeypatch):
    for spec, message in (("LANES=12", "constraint"), ("WARPS=2", "unknown size"), ("LANES", "bad entry")):
        monkeypatch.setenv("FERRUM_OPENCL_GPU_TUNING", spec)
        with pytest.raises(ValueError, match=message):
            _core.make_backend("opencl", opencl_kernels="gpu")
        _core.make_backend("opencl", opencl_kernels="cpu")  # the cpu family has no such sizes
