"""Whole models on the OpenCL backend, with each of its kernel families (FERRUM_OPENCL_KERNELS):
quantized synthetic variants against the CPU backend, decode (GEMV kernels) against prefill
(tiled kernels) on OpenCL itself, a model whose embedding is split over several device
buffers, and LoRA adapters per request against the CPU backend."""
import json
import os

import numpy as np
import pytest

import ferrum
import reference as R
from conftest import STORIES, STORIES_FORMATS
from ferrum import _core
from ferrum.tools.make_model import make_model

# hidden / intermediate multiples of 256 so every projection really is a k-quant (the generator
# falls back to legacy types for other widths).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1000)
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 24}}
PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, 1000, 45)]


@pytest.fixture(autouse=True, params=["cpu", "gpu"])
def kernel_family(request, monkeypatch):
    """Every test here runs with both kernel families (the runner makes its own backend)."""
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", request.param)
    return request.param


@pytest.fixture(scope="module", params=[(a, d) for a in ARCHS for d in ("q4_k_m", "q8_0", "q4_1", "bf16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_model(request, tmp_path_factory):
    arch, dtype = request.param
    out = tmp_path_factory.mktemp(arch) / f"{dtype}.gguf"
    return make_model(arch, "tiny", "gguf", dtype, seed=7, out=out, **SHAPE, **ARCHS[arch])


def runner(path, device):
    return _core.ModelRunner(str(path), device=device, num_threads=2, kv_dtype="f32", max_model_len=256)


def score(r, ids):
    """Logits of every position of one prefill (a fresh sequence, released afterwards)."""
    seq = r.add_sequence()
    try:
        return r.step([(seq, list(ids), "all")])
    finally:
        r.release_sequence(seq)


def test_quantized_variant_prefill_logits_equal_cpu(quantized_model):
    # 45 prompt rows: the CPU backend takes its f32 GEMM path (dequantized tiles), OpenCL its
    # tiled kernel over the same blocks: both f32 arithmetic on the same dequantized values.
    cpu = score(runner(quantized_model, "cpu"), PROMPT)
    ocl = score(runner(quantized_model, "opencl"), PROMPT)
    scale = np.abs(cpu).max()
    assert np.abs(ocl - cpu).max() < 1e-4 * max(scale, 1.0)
    assert (ocl.argmax(1) == cpu.argmax(1)).all()


def test_quantized_variant_decode_agrees_with_prefill(quantized_model):
    """Greedy tokens generated one at a time (GEMV kernels, T = 1) against a single prefill over
    prompt + generated tokens (tiled kernels, f32 activations), step by step. The decodes of the
    quantized types dot 8-bit activations (as the CPU backend's do), which moves every matmul's
    output by about 3e-5 NMSE; through the model's layers the logits move by 2e-4 .. 8e-4
    (measured over these 12 models): bound 2e-3. bf16 decodes keep f32 activations: the same
    logits to f32 accuracy, hence the same greedy tokens."""
    r = runner(quantized_model, "opencl")
    seq = r.add_sequence()
    logits, gen, decoded = r.step([(seq, PROMPT, "last")]), [], []
    while len(gen) < 10:
        gen.append(int(logits[0].argmax()))
        logits = r.step([(seq, [gen[-1]], "last")])
        decoded.append(logits[0])
    r.release_sequence(seq)
    prefill = score(r, PROMPT + gen)[len(PROMPT):]
    if quantized_model.stem == "bf16":
        assert R.nmse(np.array(decoded), prefill) < 1e-10
        assert prefill[:-1].argmax(1).tolist() == gen[1:]
    else:
        assert R.nmse(np.array(decoded), prefill) < 2e-3


def test_model_with_embedding_split_over_buffers(monkeypatch):
    """stories260K's 128 KiB embedding under a 64 KiB per-buffer limit: three buffers, and the
    greedy continuation from BOS still equals reference.json."""
    monkeypatch.setenv("FERRUM_OPENCL_MAX_ALLOC_BYTES", str(64 << 10))
    runner = _core.ModelRunner(STORIES_FORMATS["gguf"], device="opencl", kv_dtype="f32",
                               max_model_len=256, kv_cache_tokens=128)
    expect = json.load(open(os.path.join(STORIES, "reference.json")))["greedy_from_bos"]["generated_ids"][:40]
    seq = runner.add_sequence()
    logits, got = runner.step([(seq, [1], "last")]), []
    while len(got) < len(expect):
        got.append(int(logits[0].argmax()))
        logits = runner.step([(seq, [got[-1]], "last")])
    assert got == expect


def test_llm_device_strings_and_bad_device():
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], device="opencl:0:0", kv_dtype="f32")
    assert llm.runner.device == "opencl"
    with pytest.raises(ValueError, match="no OpenCL platform matches"):
        ferrum.LLM(STORIES_FORMATS["gguf"], device="opencl:9")
    with pytest.raises(ValueError, match="unknown device"):
        ferrum.LLM(STORIES_FORMATS["gguf"], device="cuda")


def test_kv_cache_larger_than_the_device_is_memory_error():
    # 10^9 tokens of f16 K and V: ~64 GB per layer pool, more than the device holds.
    with pytest.raises(MemoryError, match="cannot allocate"):
        _core.ModelRunner(STORIES_FORMATS["gguf"], device="opencl", kv_cache_tokens=10**9)


# ---- LoRA adapters per request (the adapters test_lora.py makes with PEFT) ----

LORA_NAMES = ["llama-r8", "llama-r1-qv", "llama-rank-pattern", "llama-rslora-layers", "llama-all-linear",
              "llama-r8-f16", "llama-r8-bf16", "llama-zero"]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """The tiny f32 Llama base of test_lora.py and some of its adapters (fused q/k/v parts of
    different ranks, parts and layers left out, every linear, saved in f16 and bf16)."""
    from test_lora import ADAPTERS, TOK
    from ferrum.tools.make_lora import make_lora

    root = tmp_path_factory.mktemp("lora")
    base = make_model("llama", "tiny", "hf", "f32", seed=11, tokenizer=TOK, out=root / "llama")
    adapters = {n: make_lora(base, root / n, **ADAPTERS[n][1]) for n in LORA_NAMES}
    return base, adapters


_lora_llms = {}


def lora_llm(base, device, family, lora_dtype="auto"):
    key = (device, family if device == "opencl" else None, lora_dtype)
    if key not in _lora_llms:
        _lora_llms[key] = ferrum.LLM(str(base), device=device, kv_dtype="f32", num_threads=2, kv_cache_tokens=1024,
                                     enable_lora=True, max_loras=6, max_lora_rank=8, enable_prefix_caching=False,
                                     lora_dtype=lora_dtype)
    return _lora_llms[key]


def lora_request(adapters, name, scale=1.0):
    return ferrum.LoRARequest(name, 1 + LORA_NAMES.index(name), str(adapters[name]), scale=scale) if name else None


def test_lora_logits_equal_cpu(lora_setup, kernel_family):
    """Each adapter's logits on OpenCL within the bound the base model's parity holds to."""
    from test_lora import PROMPT as LORA_PROMPT

    base, adapters = lora_setup
    cpu, ocl = lora_llm(base, "cpu", None), lora_llm(base, "opencl", kernel_family)
    base_logits = cpu.score(LORA_PROMPT)
    for name in [None] + LORA_NAMES[:-1]:
        req = lora_request(adapters, name)
        ref, got = cpu.score(LORA_PROMPT, lora_request=req), ocl.score(LORA_PROMPT, lora_request=req)
        scale = np.abs(ref).max()
        if name:
            assert np.abs(ref - base_logits).max() > 1e-2 * scale  # the adapter matters
        assert np.abs(got - ref).max() < 1e-4 * max(scale, 1.0), name


def test_lora_mixed_batch_equals_each_alone_and_zero_b_is_the_base(lora_setup, kernel_family):
    """A step mixing four adapters and the base gives each request the bits it gets alone
    (scores), and the same tokens (generation, whose decodes replay recorded steps while the
    slots change); an adapter whose B is zero gives the base's bits."""
    from test_lora import PROMPT as LORA_PROMPT

    base, adapters = lora_setup
    ocl = lora_llm(base, "opencl", kernel_family)
    names = ["llama-r8", None, "llama-r1-qv", "llama-rank-pattern", "llama-rslora-layers", "llama-r8-f16",
             "llama-r8-bf16", "llama-r8", "llama-r8"]
    scales = [1.0] * 7 + [0.5, 0.0]  # one adapter at three request scales
    reqs = [lora_request(adapters, n, s) for n, s in zip(names, scales)]
    prompts = [LORA_PROMPT[i:] + LORA_PROMPT[:i] for i in range(len(names))]
    params = ferrum.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    together = ocl.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=reqs)
    scores = ocl.score(prompts, lora_request=reqs)
    for p, r, out, s in zip(prompts, reqs, together, scores):
        assert np.array_equal(s, ocl.score(p, lora_request=r))
        alone = ocl.generate(prompt_token_ids=[p], sampling_params=params, lora_request=r)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert np.array_equal(scores[-1], ocl.score(prompts[-1]))  # scale 0: the base's bits
    zero = lora_request(adapters, "llama-zero")
    assert np.array_equal(ocl.score(LORA_PROMPT, lora_request=zero), ocl.score(LORA_PROMPT))


def test_lora_q8_0_and_request_scales_equal_cpu(lora_setup, kernel_family):
    """Adapters kept in q8_0 (lora_dtype; B's rank-8 rows in f16) and a request scale: the OpenCL
    logits within the CPU's bound, and the q8_0 adapter bit for bit as alone in a mixed batch."""
    from test_lora import PROMPT as LORA_PROMPT

    base, adapters = lora_setup
    for lora_dtype, name, scale in (("q8_0", "llama-r8", 1.0), ("q8_0", "llama-r8-f16", -1.5), ("auto", "llama-r8", 0.5)):
        cpu, ocl = lora_llm(base, "cpu", None, lora_dtype), lora_llm(base, "opencl", kernel_family, lora_dtype)
        req = lora_request(adapters, name, scale)
        ref, got = cpu.score(LORA_PROMPT, lora_request=req), ocl.score(LORA_PROMPT, lora_request=req)
        assert np.abs(got - ref).max() < 1e-4 * max(np.abs(ref).max(), 1.0), (lora_dtype, name, scale)
    q8 = lora_llm(base, "opencl", kernel_family, "q8_0")
    reqs = [lora_request(adapters, n) for n in ("llama-r8", None, "llama-all-linear")]
    prompts = [LORA_PROMPT[i:] + LORA_PROMPT[:i] for i in range(len(reqs))]
    for p, r, s in zip(prompts, reqs, q8.score(prompts, lora_request=reqs)):
        assert np.array_equal(s, q8.score(p, lora_request=r))
