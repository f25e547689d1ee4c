"""LoRA adapters per request against PEFT on transformers (float64): random-weight adapters that
PEFT itself makes and saves for generated models of the variants; ferrum's logits (f32 base, f32
KV) within 1e-4 of PEFT's relative to their scale, greedy tokens identical; batches mixing
adapters and the base equal each request alone, bit for bit; the prefix cache never shares
blocks across adapters or request scales; adapters kept in f16 / bf16 / q8_0 compute exactly what
f32 ones of those values do; every bad file is a ValueError naming what is wrong. The same adapters
through llama.cpp's own converter (GGUF) score as their PEFT directories, and as llama.cpp itself
runs them."""
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

import ferrum
from conftest import MODELS
from ferrum import LoRARequest, SamplingParams
from ferrum.lora import read_safetensors
from ferrum.tools.lora_to_gguf import convert_all
from ferrum.tools.make_lora import make_lora
from ferrum.tools.make_model import make_model

TOK = f"{MODELS}/tokenizers/smollm2-135m-instruct"
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 40000, 37)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BASES = {"llama": dict(arch="llama"), "qwen2-bias": dict(arch="qwen2"), "qwen3-qk-norm": dict(arch="qwen3"),
         "mistral-window": dict(arch="mistral", sliding_window=24), "qwen3-moe": dict(arch="qwen3_moe")}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (base, make_lora kwargs)
ADAPTERS = {
    "llama-r8": ("llama", dict(r=8, lora_alpha=16)),
    "llama-r1-qv": ("llama", dict(r=1, lora_alpha=4, target_modules=["q_proj", "v_proj"], seed=1)),
    "llama-rank-pattern": ("llama", dict(r=4, lora_alpha=8, rank_pattern={"q_proj": 2, "down_proj": 8},
                                         alpha_pattern={"v_proj": 3}, seed=2)),
    "llama-rslora-layers": ("llama", dict(r=8, lora_alpha=8, use_rslora=True, layers_to_transform=[0, 2], seed=3)),
    "llama-regex": ("llama", dict(r=2, lora_alpha=2, target_modules=r".*\.(k_proj|up_proj)", seed=4)),
    "llama-all-linear": ("llama", dict(r=4, lora_alpha=8, target_modules="all-linear", seed=5)),
    "qwen2-r8": ("qwen2-bias", dict(r=8, lora_alpha=16, seed=6)),
    "qwen3-r8": ("qwen3-qk-norm", dict(r=8, lora_alpha=16, seed=7)),
    "mistral-r8": ("mistral-window", dict(r=8, lora_alpha=16, seed=9)),
    "qwen3-moe-attention": ("qwen3-moe", dict(r=8, lora_alpha=16, target_modules=ATTENTION, seed=10)),
    "llama-zero": ("llama", dict(r=4, lora_alpha=8, zero_b=True, seed=8)),
    "llama-r8-f16": ("llama", dict(r=8, lora_alpha=16, seed=12, dtype="float16")),
    "llama-r8-bf16": ("llama", dict(r=8, lora_alpha=16, seed=13, dtype="bfloat16")),
    "llama-r16": ("llama", dict(r=16, lora_alpha=32, seed=14)),
    "llama-r64": ("llama", dict(r=64, lora_alpha=64, seed=15)),
}


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory):
    """Bases (HF, and the Llama one as GGUF too), adapters, and PEFT's float64 logits and greedy
    tokens for each adapter on PROMPT."""
    root = tmp_path_factory.mktemp("lora")
    bases = {}
    for name, kw in BASES.items():
        kw = dict(kw)
        arch = kw.pop("arch")
        bases[name] = make_model(arch, "tiny", "hf", "f32", seed=11, tokenizer=TOK, out=root / name, **kw)
    gguf = make_model("llama", "tiny", "gguf", "f32", seed=11, tokenizer=TOK, out=root / "llama.gguf")
    adapters, refs = {}, {}
    for name, (base, kw) in ADAPTERS.items():
        held = []
        adapters[name] = make_lora(bases[base], root / f"adapter-{name}", peft_model=held, **kw)
        # float64, but transformers' MoE experts run in f32 only (grouped matmuls)
        model = (held[0] if base == "qwen3-moe" else held[0].double()).eval()
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].numpy()
            greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
            base_logits = None
            with model.disable_adapter():
                base_logits = model(torch.tensor([PROMPT])).logits[0].numpy()
        refs[name] = (logits, greedy.tolist(), base_logits)
    return dict(bases=bases, gguf=gguf, adapters=adapters, refs=refs)


_llms = {}


def llm_for(path, **kw):
    """One LLM per (model, options), shared by the tests."""
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _llms:
        opts = dict(kv_dtype="f32", num_threads=2, kv_cache_tokens=1024, enable_lora=True, max_loras=4, max_lora_rank=64,
                    max_cpu_loras=8)
        opts.update(kw)
        _llms[key] = ferrum.LLM(str(path), **opts)
    return _llms[key]


def request(models, name, int_id=None):
    return LoRARequest(name, int_id or 1 + list(ADAPTERS).index(name), str(models["adapters"][name]))


def assert_close(got, ref):
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-4 * scale, (np.abs(got - ref).max(), scale)


@pytest.mark.parametrize("name", [n for n in ADAPTERS if n != "llama-zero"])
def test_logits_and_greedy_match_peft(lora_models, name):
    logits, greedy, base_logits = lora_models["refs"][name]
    assert np.abs(logits - base_logits).max() > 1e-2 * np.abs(base_logits).max()  # the adapter matters
    llm = llm_for(lora_models["bases"][ADAPTERS[name][0]])
    req = request(lora_models, name)
    assert_close(llm.score(PROMPT, lora_request=req), logits)
    assert_close(llm.score(PROMPT), base_logits)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=req)
    assert out[0].outputs[0].token_ids == greedy


@pytest.mark.parametrize("name", ["llama-r8", "llama-rank-pattern"])
def test_gguf_base_takes_the_same_adapter(lora_models, name):
    """llama.cpp's converter permutes a Llama's q/k rows: the adapter's B rows follow them."""
    logits, greedy, _ = lora_models["refs"][name]
    llm = llm_for(lora_models["gguf"])
    assert_close(llm.score(PROMPT, lora_request=request(lora_models, name)), logits)


@pytest.mark.parametrize("name", ["llama-r8", "llama-rank-pattern"])
def test_quantized_base_takes_the_adapter_as_peft_on_its_values(lora_models, tmp_path, name):
    """On a Q8_0 GGUF of the base, ferrum's logits with the adapter are PEFT's (float64) on
    transformers' own dequantized load of that file, within 1e-4 of their scale: the quantized
    base's values, the same adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    q8 = make_model("llama", "tiny", "gguf", "q8_0", seed=11, tokenizer=TOK, out=tmp_path / "q8.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=q8.name, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(lora_models["adapters"][name])).double().eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    assert_close(llm_for(q8).score(PROMPT, lora_request=request(lora_models, name)), ref)


def test_every_entry_point_takes_the_adapter(lora_models):
    """stream, add_request / step, chat and AsyncLLM.generate run a request on its adapter: the
    tokens and text generate gives with it, which are not the base's."""
    import asyncio
    from ferrum.async_llm import AsyncLLM
    llm = ferrum.LLM(str(lora_models["bases"]["llama"]), kv_dtype="f32", num_threads=2, kv_cache_tokens=1024,
                     enable_lora=True, max_loras=2, max_lora_rank=8)
    req = request(lora_models, "llama-r8")
    want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=req)[0].outputs[0]
    assert want.token_ids != llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0].outputs[0].token_ids
    assert "".join(llm.stream(PROMPT, GREEDY, lora_request=req)) == want.text
    rid = llm.add_request(PROMPT, GREEDY, lora_request=req)
    done = None
    while done is None:
        done = next((d.output for d in llm.step() if d.request_id == rid and d.finished), None)
    assert done.outputs[0].token_ids == want.token_ids
    llm.tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "Hello"}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chatted = llm.generate([text], GREEDY, lora_request=req)[0].outputs[0]
    assert chatted.token_ids != llm.generate([text], GREEDY)[0].outputs[0].token_ids
    assert llm.chat(messages, GREEDY, lora_request=req).outputs[0].token_ids == chatted.token_ids

    async def run_async():
        tokens = []
        async with AsyncLLM(llm) as engine:
            async for delta in engine.generate(PROMPT, GREEDY, lora_request=req):
                tokens += delta.outputs[0].token_ids if delta.outputs else []
        return tokens
    assert asyncio.run(run_async()) == want.token_ids


def test_zero_b_adapter_equals_the_base(lora_models):
    llm = llm_for(lora_models["bases"]["llama"])
    req = request(lora_models, "llama-zero")
    assert np.array_equal(llm.score(PROMPT, lora_request=req), llm.score(PROMPT))
    a = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=req)
    b = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def batched_equals_alone(llm, reqs):
    """Rotations of PROMPT, one per request, generated and scored together: each gets the tokens
    and the score bits it gets alone. Returns (prompts, outputs, scores) of the batch."""
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(len(reqs))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=reqs)
    scores = llm.score(prompts, lora_request=reqs)
    for p, r, out, score in zip(prompts, reqs, together, scores):
        alone = llm.generate(prompt_token_ids=[p], sampling_params=params, lora_request=r)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert np.array_equal(score, llm.score(p, lora_request=r))
    return prompts, together, scores


@pytest.mark.parametrize("lora_dtype", ["auto", "q8_0"])
def test_a_batch_mixing_adapters_equals_each_alone(lora_models, lora_dtype):
    """Scores (f32 activations, which the base computes the same in any batch) bit for bit;
    generations token for token; adapters kept in f32, f16 and bf16 (auto) or q8_0."""
    llm = llm_for(lora_models["bases"]["llama"], enable_prefix_caching=False, max_loras=6, lora_dtype=lora_dtype)
    names = ["llama-r8", None, "llama-r1-qv", "llama-rank-pattern", "llama-rslora-layers", "llama-r8-f16",
             "llama-r8-bf16"]
    reqs = [request(lora_models, n) if n else None for n in names]
    batched_equals_alone(llm, reqs)


def _as_f32(adapter, out):
    """A copy of the PEFT directory `adapter` with its tensors saved as f32 (the same values)."""
    from safetensors.numpy import save_file
    shutil.copytree(adapter, out)
    weights = out / "adapter_model.safetensors"
    save_file(read_safetensors(weights), str(weights))
    return out


@pytest.mark.parametrize("name", ["llama-r8-f16", "llama-r8-bf16"])
def test_half_adapters_stay_half_and_compute_as_their_f32_values(lora_models, tmp_path, name):
    """An adapter saved in f16 / bf16 is kept so (half the bytes of its f32 copy) and its logits
    are bit for bit those of the same values saved in f32."""
    dtypes = {}
    read_safetensors(lora_models["adapters"][name] / "adapter_model.safetensors", dtypes)
    assert set(dtypes.values()) == {name.rsplit("-", 1)[1]}
    llm = llm_for(lora_models["bases"]["llama"])
    half = request(lora_models, name)
    f32 = LoRARequest(f"{name}-f32", 300, str(_as_f32(lora_models["adapters"][name], tmp_path / "f32")))
    assert 2 * llm._loras.get(half).bytes == llm._loras.get(f32).bytes
    assert np.array_equal(llm.score(PROMPT, lora_request=half), llm.score(PROMPT, lora_request=f32))


@pytest.mark.parametrize("lora_dtype", ["float16", "bfloat16", "q8_0"])
def test_lora_dtype_converts_as_the_adapter_loads(lora_models, tmp_path, lora_dtype):
    """lora_dtype: an f32 adapter kept in that dtype computes, bit for bit, what an f32 adapter of
    its values rounded so computes (q8_0: B's rank-8 rows are no whole block and stay f16), near
    PEFT's f32 adapter, in fewer bytes, under a cache key of its own."""
    from safetensors.numpy import save_file
    from ferrum import _core
    from ferrum.lora import cache_key, read_adapter
    src, base = lora_models["adapters"]["llama-r8"], lora_models["bases"]["llama"]
    rounded = _as_f32(src, tmp_path / "rounded")
    weights = rounded / "adapter_model.safetensors"
    values = read_safetensors(weights)
    for key, v in values.items():
        t = {"float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0" if v.shape[1] % 32 == 0 else "f16"}[lora_dtype]
        values[key] = _core.quant.dequantize(t, _core.quant.quantize(t, v.ravel()), v.size).reshape(v.shape)
    save_file(values, str(weights))
    kept, f32 = llm_for(base, lora_dtype=lora_dtype), llm_for(base)
    req = request(lora_models, "llama-r8")
    got = kept.score(PROMPT, lora_request=req)
    assert np.array_equal(got, f32.score(PROMPT, lora_request=LoRARequest("rounded", 301, str(rounded))))
    assert relative_gap(got, lora_models["refs"]["llama-r8"][0]) < 5e-2
    assert kept._loras.get(req).bytes < 0.6 * f32._loras.get(req).bytes
    cfg = kept.config
    assert cache_key(read_adapter(src, cfg, 8, lora_dtype)) != cache_key(read_adapter(src, cfg, 8))
    with pytest.raises(ValueError, match="lora_dtype"):
        ferrum.LLM(str(base), enable_lora=True, lora_dtype="int4")


# ---- a request's scale of its adapter (llama.cpp's per-request lora scale) ----
def _peft_logits(base, adapter, b_scale):
    """PEFT's float64 logits on PROMPT with the adapter's B multiplied by b_scale."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.mul_(b_scale)
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("scale", [0.5, -2.0])
def test_request_scale_is_peft_with_b_scaled(lora_models, scale):
    llm = llm_for(lora_models["bases"]["llama"])
    req = dataclasses.replace(request(lora_models, "llama-r8"), scale=scale)
    assert_close(llm.score(PROMPT, lora_request=req),
                 _peft_logits(lora_models["bases"]["llama"], lora_models["adapters"]["llama-r8"], scale))


def test_request_scales_share_a_step_and_scale_0_is_the_base(lora_models):
    """Requests on one adapter at different scales (and the base) in one batch: each gets the
    bits it gets alone; scale 0 gets the base's; the adapter is loaded once."""
    llm = llm_for(lora_models["bases"]["llama"], enable_prefix_caching=False)
    r8 = request(lora_models, "llama-r8")
    reqs = [dataclasses.replace(r8, scale=s) for s in (1.0, 0.5, 0.0, -1.0)] + [None]
    prompts, together, scores = batched_equals_alone(llm, reqs)
    assert not np.array_equal(scores[0], scores[1])
    assert np.array_equal(scores[2], llm.score(prompts[2]))
    base = llm.generate(prompt_token_ids=[prompts[2]], sampling_params=SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert together[2].outputs[0].token_ids == base.outputs[0].token_ids
    assert llm.list_loras().count(r8.lora_int_id) == 1


def test_prefix_cache_is_keyed_by_request_scale(lora_models):
    llm = ferrum.LLM(str(lora_models["bases"]["llama"]), kv_dtype="f32", num_threads=2, kv_cache_tokens=1024,
                     enable_lora=True, max_loras=2, max_lora_rank=8)
    one = request(lora_models, "llama-r8")
    half = dataclasses.replace(one, scale=0.5)
    params = SamplingParams(max_tokens=1, temperature=0)

    def hits(req):
        before = llm.stats()["prefix_hit_tokens"]
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, lora_request=req)
        return llm.stats()["prefix_hit_tokens"] - before

    assert hits(one) == 0
    assert hits(half) == 0  # the same prompt and adapter at another scale computes its own blocks
    assert hits(dataclasses.replace(one, scale=0.0)) == 0
    assert hits(half) == 32 and hits(one) == 32


def test_more_adapters_than_max_loras_wait_their_turn(lora_models):
    """max_loras=1: requests on three adapters and the base all finish, each as it runs alone."""
    llm = llm_for(lora_models["bases"]["llama"], max_loras=1, enable_prefix_caching=False)
    names = ["llama-r8", "llama-r1-qv", None, "llama-regex"]
    reqs = [request(lora_models, n) if n else None for n in names]
    together = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=GREEDY, lora_request=reqs)
    for name, out in zip(names, together):
        if name:
            assert out.outputs[0].token_ids == lora_models["refs"][name][1]
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids


def test_prefix_cache_is_keyed_by_adapter(lora_models):
    llm = ferrum.LLM(str(lora_models["bases"]["llama"]), kv_dtype="f32", num_threads=2, kv_cache_tokens=1024, enable_lora=True,
                     max_loras=2, max_lora_rank=8)
    a, b = request(lora_models, "llama-r8"), request(lora_models, "llama-rank-pattern")
    same_as_a = LoRARequest("again", 77, str(lora_models["adapters"]["llama-r8"]))  # same content, other id
    params = SamplingParams(max_tokens=1, temperature=0)

    def hits(req):
        before = llm.stats()["prefix_hit_tokens"]
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, lora_request=req)
        return llm.stats()["prefix_hit_tokens"] - before, out[0].outputs[0].token_ids

    assert hits(a)[0] == 0
    assert hits(b)[0] == 0  # the same prompt under another adapter computes its own blocks
    assert hits(None)[0] == 0
    assert hits(a)[0] == 32  # its own blocks (two full ones of the 37 tokens)
    assert hits(same_as_a)[0] == 32  # the same content and scales: the same blocks
    assert_close(llm.score(PROMPT, lora_request=b), lora_models["refs"]["llama-rank-pattern"][0])


def test_chunked_prefill_and_prompt_logprobs_with_an_adapter(lora_models):
    """A prompt prefilled 5 tokens a step under an adapter scores and generates as PEFT does, and
    its prompt logprobs are the adapter's teacher-forced ones."""
    name = "llama-rank-pattern"
    logits, greedy, _ = lora_models["refs"][name]
    req = request(lora_models, name)
    llm = llm_for(lora_models["bases"]["llama"], max_num_batched_tokens=5, enable_prefix_caching=False)
    assert_close(llm.score(PROMPT, lora_request=req), logits)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, lora_request=req)[0]
    assert out.outputs[0].token_ids == greedy
    want = llm.token_logprobs(PROMPT, start=1, lora_request=req).logprobs
    got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    # this random model's logprobs reach -170: f32 rounding is relative
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    ref = torch.log_softmax(torch.tensor(logits[:-1]), -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert_close(np.array(got), ref.numpy())


def test_preempted_requests_on_adapters_equal_each_alone(lora_models):
    """A pool too small for the batch preempts and recomputes requests on adapters: each finishes
    with the tokens it gets alone."""
    names = ["llama-r8", None, "llama-r1-qv", "llama-regex"] * 2
    reqs = [request(lora_models, n) if n else None for n in names]
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(len(reqs))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = llm_for(lora_models["bases"]["llama"], enable_prefix_caching=False, kv_cache_tokens=12 * 16)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=reqs)
    assert llm.stats()["preemptions"] > 0
    alone = llm_for(lora_models["bases"]["llama"], enable_prefix_caching=False)
    for p, r, out in zip(prompts, reqs, together):
        want = alone.generate(prompt_token_ids=[p], sampling_params=params, lora_request=r)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_verifies_with_the_adapter(lora_models, method):
    """Prompt lookup, or the base model as a draft (which runs without the adapter): the target
    verifies with each request's adapter, so the tokens are those of plain greedy decoding with it."""
    base = lora_models["bases"]["llama"]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
            if method == "ngram" else {"model": str(base), "num_speculative_tokens": 3})
    names = ["llama-r8", None, "llama-rank-pattern"]
    reqs = [request(lora_models, n) if n else None for n in names]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = llm_for(base, enable_prefix_caching=False)
    # Each prompt, its own greedy continuation and the prompt again: prompt lookup finds the repeat.
    starts = [PROMPT[3 * i:3 * i + 12] for i in range(len(reqs))]
    prompts = [p + plain.generate(prompt_token_ids=[p], sampling_params=params, lora_request=r)[0].outputs[0].token_ids + p
               for p, r in zip(starts, reqs)]
    want = [plain.generate(prompt_token_ids=[p], sampling_params=params, lora_request=r)[0].outputs[0].token_ids
            for p, r in zip(prompts, reqs)]
    assert want[0] != want[1] and want[2] != want[1]  # the adapters change the tokens
    llm = llm_for(base, enable_prefix_caching=False, speculative_config=json.dumps(spec))
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in got] == want
    st = llm.stats()
    assert st["spec_proposed_tokens"] > 0
    if method == "draft":  # the draft, without the adapters, proposes some of their tokens wrong
        assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"]


def test_lru_and_remove(lora_models):
    llm = llm_for(lora_models["bases"]["llama"], max_cpu_loras=2)
    r8, r1, rp = (request(lora_models, n) for n in ("llama-r8", "llama-r1-qv", "llama-rank-pattern"))
    for r in (r8, r1, r8, rp):
        llm.add_lora(r)
    assert llm.list_loras() == [r8.lora_int_id, rp.lora_int_id]  # r1 was least recently used
    assert llm.remove_lora(r8.lora_int_id) and not llm.remove_lora(r8.lora_int_id)
    assert llm.list_loras() == [rp.lora_int_id]
    # reloaded on its next use
    assert_close(llm.score(PROMPT, lora_request=r8), lora_models["refs"]["llama-r8"][0])


def test_lora_needs_enable_lora(lora_models):
    llm = llm_for(lora_models["bases"]["llama"], enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=request(lora_models, "llama-r8"))
    with pytest.raises(ValueError, match="enable_lora"):
        llm.score(PROMPT, lora_request=request(lora_models, "llama-r8"))


def test_bad_requests():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/tmp")
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39, "0.5", True, None):
        with pytest.raises(ValueError, match="scale"):
            LoRARequest("x", 1, "/tmp", scale=bad)


# ---- bad files: a copy of a good adapter, damaged one way each ----
def _write_tensors(path, tensors):
    from safetensors.numpy import save_file
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _edit_config(path, **changes):
    f = path / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _set(key, value):
    return lambda t: {**t, key: value}


BAD_FILES = {
    "pickle": (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"), "pickled"),
    "no-config": (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json"),
    "dora": (lambda d: _edit_config(d, use_dora=True), "DoRA"),
    "modules-to-save": (lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    "lora-bias": (lambda d: _edit_config(d, lora_bias=True), "lora_bias"),
    "lm-head": (lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]), "lm_head targets"),
    "embedding": (lambda d: _edit_config(d, target_modules=["q_proj", "embed_tokens"]), "embedding targets"),
    "not-lora": (lambda d: _edit_config(d, peft_type="IA3"), "peft_type"),
    "bad-r": (lambda d: _edit_config(d, r=0), "r must be"),
    "bad-targets": (lambda d: _edit_config(d, target_modules=[]), "target_modules"),
    "missing-key": ("tensors", _drop(f"{Q0}.lora_B.weight"), "missing tensor .*q_proj.lora_B"),
    "extra-key": (lambda d: _edit_config(d, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                            "down_proj"]), "extra tensors .*gate_proj"),
    "unknown-module": ("tensors", _set("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
                                       np.zeros((8, 64), np.float32)), "does not have"),
    "dora-magnitude": ("tensors", _set(f"{Q0}.lora_magnitude_vector", np.ones(64, np.float32)), "DoRA"),
    "bias-tensor": ("tensors", _set(f"{Q0}.lora_B.bias", np.ones(64, np.float32)), "lora_bias"),
    "shape": ("tensors", _set(f"{Q0}.lora_A.weight", np.zeros((8, 65), np.float32)), r"q_proj.lora_A.weight is \[8, 65\]"),
    "rank-mismatch": ("tensors", _set(f"{Q0}.lora_A.weight", np.zeros((4, 64), np.float32)), r"lora_A.weight is \[4, 64\]"),
    "nan": ("tensors", _set(f"{Q0}.lora_B.weight", np.full((64, 8), np.nan, np.float32)), "q_proj.lora_B.weight has non-finite"),
    "int-dtype": ("tensors", _set(f"{Q0}.lora_B.weight", np.zeros((64, 8), np.int32)), "dtype I32"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_a_value_error(lora_models, tmp_path, case):
    d = tmp_path / "adapter"
    shutil.copytree(lora_models["adapters"]["llama-r8"], d)
    spec = BAD_FILES[case]
    if spec[0] == "tensors":
        _write_tensors(d, spec[1](read_safetensors(d / "adapter_model.safetensors")))
        match = spec[2]
    else:
        spec[0](d)
        match = spec[1]
    llm = llm_for(lora_models["bases"]["llama"])
    with pytest.raises(ValueError, match=match):
        llm.score(PROMPT, lora_request=LoRARequest(case, 500 + list(BAD_FILES).index(case), str(d)))
    assert_close(llm.score(PROMPT), lora_models["refs"]["llama-r8"][2])  # the model goes on


@pytest.mark.parametrize("target, feature", [("gate_proj", "expert targets"), ("gate", "router targets")])
def test_moe_expert_and_router_targets_are_refused(lora_models, tmp_path, target, feature):
    """An adapter on a Qwen3-MoE's experts or router is refused by name; its attention is served."""
    d = tmp_path / "adapter"
    shutil.copytree(lora_models["adapters"]["qwen3-moe-attention"], d)
    _edit_config(d, target_modules=ATTENTION + [target])
    llm = llm_for(lora_models["bases"]["qwen3-moe"])
    with pytest.raises(ValueError, match=feature):
        llm.score(PROMPT, lora_request=LoRARequest(target, 600 + len(target), str(d)))
    assert_close(llm.score(PROMPT, lora_request=request(lora_models, "qwen3-moe-attention")),
                 lora_models["refs"]["qwen3-moe-attention"][0])


def test_rank_over_max_lora_rank(lora_models):
    llm = llm_for(lora_models["bases"]["llama"], max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 is more than max_lora_rank 4"):
        llm.add_lora(request(lora_models, "llama-r8"))


# ---- the server: `model` chooses the adapter ----
def test_server_serves_adapters_by_model_name(lora_models, gguf_adapters):
    import requests
    from server_harness import running_server
    from ferrum.server.main import parse_lora_modules

    loras = parse_lora_modules([f"r8={lora_models['adapters']['llama-r8']}",
                                json.dumps({"name": "pattern", "path": str(lora_models["adapters"]["llama-rank-pattern"])}),
                                f"r8-gguf={gguf_adapters['llama-r8']}"])
    llm = ferrum.LLM(str(lora_models["bases"]["llama"]), kv_dtype="f32", num_threads=2, kv_cache_tokens=1024,
                     enable_lora=True, max_loras=2, max_lora_rank=8)
    with running_server(llm, "base", lora_modules=loras) as (url, _):
        models = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("r8", "base"), ("pattern", "base"),
                                                            ("r8-gguf", "base")]

        def complete(model, **extra):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
            r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def greedy(lora_request):
            out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=lora_request)
            return llm.tokenizer.decode(out[0].outputs[0].token_ids)

        for model, name in (("r8", "llama-r8"), ("pattern", "llama-rank-pattern"), ("r8-gguf", "llama-r8")):
            assert complete(model) == llm.tokenizer.decode(lora_models["refs"][name][1])  # PEFT's greedy tokens
        assert complete("base") == greedy(None)
        # lora_scale: the request's scale of the adapter `model` names
        r8 = loras[0]
        assert complete("r8", lora_scale=0.5) == greedy(dataclasses.replace(r8, scale=0.5))
        assert complete("r8", lora_scale=0) == complete("base")

        def embedding(model, **extra):
            e = requests.post(f"{url}/v1/embeddings", json={"model": model, "input": "Hi", **extra}, timeout=60)
            assert e.status_code == 200, e.text
            return e.json()["data"][0]["embedding"]

        assert embedding("r8", lora_scale=0) == embedding("base") != embedding("r8") == embedding("r8", lora_scale=1)
        for model, scale in (("r8", "half"), ("r8", float("nan")), ("r8", 1e39), ("base", 0.5), (None, 1.0)):
            body = {"prompt": PROMPT, "max_tokens": 1, "lora_scale": scale, **({"model": model} if model else {})}
            r = requests.post(f"{url}/v1/completions", data=json.dumps(body), timeout=10,
                              headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "lora_scale" in r.text, (model, scale, r.text)
        r = requests.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
        assert r.status_code == 404
        for route in ("load_lora_adapter", "unload_lora_adapter"):  # not served without enable_lora_updates
            body = {"lora_name": "x", "lora_path": str(lora_models["adapters"]["llama-r8"])}
            assert requests.post(f"{url}/v1/{route}", json=body, timeout=10).status_code == 404
        assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]] == [
            "base", "r8", "pattern", "r8-gguf"]


# ---- the server: adapters loaded and unloaded while it serves (enable_lora_updates) ----
def _updates_server(lora_models, **app_kwargs):
    from server_harness import running_server
    llm = ferrum.LLM(str(lora_models["bases"]["llama"]), kv_dtype="f32", num_threads=2, kv_cache_tokens=1024,
                     enable_lora=True, max_loras=2, max_lora_rank=8)
    return llm, running_server(llm, "base", enable_lora_updates=True, **app_kwargs)


def _post(url, route, body):
    import requests
    return requests.post(f"{url}/v1/{route}", json=body, timeout=60)


def _models(url):
    import requests
    return [(m["id"], m["parent"], m["root"]) for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]


def _greedy(client, model, max_tokens=8):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _lora_counters(url):
    """/metrics' per-adapter counters: {(metric, lora_name): value}, each labelled with the base's
    name, and the totals over all requests: {(metric, None): value}."""
    import re
    import requests
    text = requests.get(f"{url}/metrics", timeout=10).text
    found = {(name, None): float(v) for name, v in
             re.findall(r'^(ferrum:(?:prompt|generation)_tokens_total)\{model_name="base"\} (\S+)$', text, re.M)}
    for m in re.finditer(r'^(ferrum:lora_\w+_total)\{(.*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        assert labels["model_name"] == "base"
        found[m.group(1), labels["lora_name"]] = float(m.group(3))
    return found


def test_server_loads_and_unloads_adapters(lora_models, gguf_adapters, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter (PEFT or GGUF)
    serves PEFT's greedy tokens and is listed under the base; unloaded, it is a 404; a changed file
    loaded again under the same name (after an unload, or in place) serves the new content, none
    of the old one's prefix-cache blocks (which the same content under another name does reuse);
    /metrics counts by adapter."""
    import openai
    live = tmp_path / "live"
    shutil.copytree(lora_models["adapters"]["llama-r8"], live)
    llm, server = _updates_server(lora_models)
    decode = llm.tokenizer.decode
    r8_text, pattern_text = (decode(lora_models["refs"][n][1]) for n in ("llama-r8", "llama-rank-pattern"))
    assert r8_text != pattern_text
    with server as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        hits = lambda: engine.stats()["prefix_hit_tokens"]  # noqa: E731
        r = _post(url, "load_lora_adapter", {"lora_name": "live", "lora_path": str(live)})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'live' added successfully."
        r = _post(url, "load_lora_adapter", {"lora_name": "live-gguf", "lora_path": str(gguf_adapters["llama-r8"])})
        assert r.status_code == 200, r.text
        assert _models(url)[1:] == [("live", "base", str(live)), ("live-gguf", "base", str(gguf_adapters["llama-r8"]))]
        assert [m.id for m in client.models.list().data] == ["base", "live", "live-gguf"]
        assert _greedy(client, "live") == r8_text  # PEFT's tokens
        before = hits()
        assert _greedy(client, "live") == r8_text
        assert hits() - before == 32  # its own blocks (two full ones of the 37 tokens)
        assert _greedy(client, "live-gguf") == r8_text
        base_text = _greedy(client, "base")
        assert base_text != r8_text

        r = _post(url, "unload_lora_adapter", {"lora_name": "live"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'live' removed successfully."
        assert [m[0] for m in _models(url)] == ["base", "live-gguf"]
        with pytest.raises(openai.NotFoundError):
            _greedy(client, "live")

        # Another adapter's files at the same path, loaded under the same name.
        shutil.rmtree(live)
        shutil.copytree(lora_models["adapters"]["llama-rank-pattern"], live)
        assert _post(url, "load_lora_adapter", {"lora_name": "live", "lora_path": str(live)}).status_code == 200
        before = hits()
        assert _greedy(client, "live") == pattern_text
        assert _greedy(client, "live") == pattern_text
        # 32 over both: the second found the first's blocks, so the first found none of the old
        # content's (nor of the base's), though they are still cached (below)
        assert hits() - before == 32
        # The old content's blocks are still cached: under another name, it finds them.
        r = _post(url, "load_lora_adapter", {"lora_name": "again", "lora_path": str(lora_models["adapters"]["llama-r8"])})
        assert r.status_code == 200, r.text
        before = hits()
        assert _greedy(client, "again") == r8_text
        assert hits() - before == 32

        # vLLM's load_inplace: "live" serves a third content from the next request on.
        r1 = str(lora_models["adapters"]["llama-r1-qv"])
        r = _post(url, "load_lora_adapter", {"lora_name": "live", "lora_path": r1, "load_inplace": True})
        assert r.status_code == 200, r.text
        assert [m for m in _models(url) if m[0] == "live"] == [("live", "base", r1)]
        before = hits()
        assert _greedy(client, "live") == decode(lora_models["refs"]["llama-r1-qv"][1])
        assert _greedy(client, "live") == decode(lora_models["refs"]["llama-r1-qv"][1])
        assert hits() - before == 32
        assert 3 not in llm.list_loras()  # the replaced one (the third load) is dropped

        counters = _lora_counters(url)
        runs = {"live": 6, "live-gguf": 1, "base": 1, "again": 1}
        assert counters == {
            **{("ferrum:lora_requests_total", name): n for name, n in runs.items()},
            **{("ferrum:lora_prompt_tokens_total", name): n * len(PROMPT) for name, n in runs.items()},
            **{("ferrum:lora_generation_tokens_total", name): n * 8 for name, n in runs.items()},
            ("ferrum:prompt_tokens_total", None): 9 * len(PROMPT), ("ferrum:generation_tokens_total", None): 9 * 8}


def test_server_unload_lets_running_requests_finish(lora_models):
    """A request running on an adapter when it is unloaded finishes with it: the tokens of the
    same adapter loaded again, not cut short."""
    import openai
    llm, server = _updates_server(lora_models)
    path = str(lora_models["adapters"]["llama-r8"])
    with server as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        assert _post(url, "load_lora_adapter", {"lora_name": "a", "lora_path": path}).status_code == 200
        stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        assert _post(url, "unload_lora_adapter", {"lora_name": "a"}).status_code == 200
        assert engine.stats()["running"] == 1  # unloaded while it ran
        chunks += list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert _post(url, "load_lora_adapter", {"lora_name": "b", "lora_path": path}).status_code == 200
        assert text == _greedy(client, "b", 400)  # the adapter's tokens (its first 8 are not the base's)
        assert llm.list_loras() == [2]  # "a" (id 1) was dropped; "b" has a fresh id


def test_serve_enable_lora_updates(lora_models):
    """`ferrum serve --enable-lora-updates` (no other LoRA flag): the routes are there and a loaded
    adapter serves PEFT's tokens; the process exits cleanly after."""
    import requests
    from server_harness import serve, stop
    proc, url = serve(str(lora_models["bases"]["llama"]), "--enable-lora-updates", "--max-lora-rank", "8",
                      "--kv-dtype", "f32", "--no-web-ui")
    try:
        r = _post(url, "load_lora_adapter", {"lora_name": "r8", "lora_path": str(lora_models["adapters"]["llama-r8"])})
        assert r.status_code == 200, r.text
        assert [(m[0], m[1]) for m in _models(url)] == [("smollm2", None), ("r8", "smollm2")]
        body = {"model": "r8", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
        decode = llm_for(lora_models["bases"]["llama"]).tokenizer.decode
        assert r.json()["choices"][0]["text"] == decode(lora_models["refs"]["llama-r8"][1])
        assert _post(url, "unload_lora_adapter", {"lora_name": "r8"}).status_code == 200
    finally:
        stop(proc)
    assert proc.returncode == 0


# (body, status, what the error says); "{name}" in a path: a file of the test's
LOAD_ERRORS = [
    ({"lora_path": "/x"}, 400, "lora_name: Field required"),
    ({"lora_name": "x"}, 400, "lora_path: Field required"),
    ({"lora_name": "", "lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path' must be provided"),
    ({"lora_name": "x", "lora_path": "/x", "scale": 2}, 400, "scale: Extra inputs are not permitted"),
    ({"lora_name": "r8", "lora_path": "{r8}"}, 400, "The lora adapter 'r8' has already been loaded."),
    ({"lora_name": "r8", "lora_path": "{dora}", "load_inplace": True}, 400, "DoRA (use_dora) is not supported"),
    ({"lora_name": "base", "lora_path": "{r8}"}, 400, "The name 'base' is the base model's."),
    ({"lora_name": "x", "lora_path": "{missing}"}, 400, "missing: not a PEFT adapter directory"),
    ({"lora_name": "x", "lora_path": "{missing}.gguf"}, 400, "missing.gguf: cannot open"),
    ({"lora_name": "x", "lora_path": "{dora}"}, 400, "DoRA (use_dora) is not supported"),
    ({"lora_name": "x", "lora_path": "{model_gguf}"}, 400, "not 'adapter' (a model, not an adapter?)"),
    ({"lora_name": "x", "lora_path": "{junk_gguf}"}, 400, "junk.gguf"),
    ({"lora_name": "x", "lora_path": "{big}"}, 400, "rank 16 is more than max_lora_rank 8"),
]


def test_server_load_errors(lora_models, tmp_path):
    """Each refused load is its 4xx with the reason (the loader's message for a bad adapter);
    nothing is loaded, the name stays free (or serves what it served: a bad in-place load), the
    server goes on, and the name then loads a good adapter."""
    import openai
    from ferrum.server.main import parse_lora_modules
    r8 = str(lora_models["adapters"]["llama-r8"])
    shutil.copytree(r8, tmp_path / "dora")
    _edit_config(tmp_path / "dora", use_dora=True)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    big = make_lora(lora_models["bases"]["llama"], tmp_path / "big", r=16, lora_alpha=16, target_modules=["q_proj"])
    paths = dict(r8=r8, missing=str(tmp_path / "missing"), dora=str(tmp_path / "dora"),
                 model_gguf=str(lora_models["gguf"]), junk_gguf=str(tmp_path / "junk.gguf"), big=str(big))
    llm, server = _updates_server(lora_models, lora_modules=parse_lora_modules([f"r8={r8}"]))
    with server as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        loaded = llm.list_loras()
        for body, status, message in LOAD_ERRORS:
            body = {k: v.format(**paths) if isinstance(v, str) else v for k, v in body.items()}
            r = _post(url, "load_lora_adapter", body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert message in error["message"] and error["code"] == status, (body, error)
            assert [m[0] for m in _models(url)] == ["base", "r8"]
            assert llm.list_loras() == loaded
            with pytest.raises(openai.NotFoundError):
                _greedy(client, "x")
        assert _greedy(client, "r8") == llm.tokenizer.decode(lora_models["refs"]["llama-r8"][1])
        r = _post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": str(lora_models["adapters"]["llama-r1-qv"]),
                                             "load_inplace": True})  # in place of nothing: a load
        assert r.status_code == 200, r.text
        assert _greedy(client, "x") == llm.tokenizer.decode(lora_models["refs"]["llama-r1-qv"][1])


UNLOAD_ERRORS = [
    ({}, 400, "lora_name: Field required"),
    ({"lora_name": ""}, 400, "'lora_name' needs to be provided"),
    ({"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
    ({"lora_name": "base"}, 404, "The lora adapter 'base' cannot be found."),
]


def test_server_unload_errors(lora_models):
    """Each refused unload is its 4xx, and what was served still is; a --lora-modules adapter
    unloads like a loaded one, once."""
    import openai
    from ferrum.server.main import parse_lora_modules
    r8 = str(lora_models["adapters"]["llama-r8"])
    llm, server = _updates_server(lora_models, lora_modules=parse_lora_modules([f"r8={r8}"]))
    with server as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        for body, status, message in UNLOAD_ERRORS:
            r = _post(url, "unload_lora_adapter", body)
            assert r.status_code == status, (body, r.text)
            assert message in r.json()["error"]["message"], (body, r.text)
            assert _greedy(client, "r8") == llm.tokenizer.decode(lora_models["refs"]["llama-r8"][1])
            assert _greedy(client, "base") != _greedy(client, "r8")
        assert _post(url, "unload_lora_adapter", {"lora_name": "r8"}).status_code == 200
        assert _post(url, "unload_lora_adapter", {"lora_name": "r8"}).status_code == 404
        assert llm.list_loras() == []
        with pytest.raises(openai.NotFoundError):
            _greedy(client, "r8")


@pytest.mark.parametrize("item", ["r8", "=path", '{"name": "x"}', "{not json"])
def test_bad_lora_modules(item):
    from ferrum.server.main import parse_lora_modules
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_modules([item])


# ---- llama.cpp's GGUF adapters: PEFT adapters above through llama.cpp's convert_lora_to_gguf.py ----
# name -> (the PEFT adapter, the converter's --outtype). The converter keeps r, lora_alpha and the
# tensors, not use_rslora or alpha_pattern (llama.cpp scales by alpha / r): adapters without them.
GGUF_ADAPTERS = {"llama-r8": ("llama-r8", "f32"), "qwen3-r8": ("qwen3-r8", "f32"), "mistral-r8": ("mistral-r8", "f32"),
                 "qwen3-moe-attention": ("qwen3-moe-attention", "f32"), "llama-r8-f16": ("llama-r8", "f16"),
                 "qwen3-r8-bf16": ("qwen3-r8", "bf16"), "llama-r8-q8_0": ("llama-r8", "q8_0")}


@pytest.fixture(scope="session")
def gguf_adapters(lora_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf")
    files = convert_all([(lora_models["adapters"][src], lora_models["bases"][ADAPTERS[src][0]], root / f"{name}.gguf",
                          outtype) for name, (src, outtype) in GGUF_ADAPTERS.items()])
    return dict(zip(GGUF_ADAPTERS, files))


def gguf_request(gguf_adapters, name):
    return LoRARequest(f"{name}.gguf", 100 + list(GGUF_ADAPTERS).index(name), str(gguf_adapters[name]))


def relative_gap(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", ["llama-r8", "qwen3-r8", "mistral-r8", "qwen3-moe-attention"])
def test_gguf_adapter_scores_as_its_peft_directory(lora_models, gguf_adapters, name):
    """f32 keeps every value and the converter's q/k row permutation (Llama, Mistral) is undone
    for an HF base and kept for a GGUF one: bit for bit the PEFT directory's logits."""
    base = ADAPTERS[name][0]
    for path in [lora_models["bases"][base]] + ([lora_models["gguf"]] if base == "llama" else []):
        llm = llm_for(path)
        peft = llm.score(PROMPT, lora_request=request(lora_models, name))
        assert np.array_equal(llm.score(PROMPT, lora_request=gguf_request(gguf_adapters, name)), peft)
    req = gguf_request(gguf_adapters, name)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, lora_request=req)
    assert out[0].outputs[0].token_ids == lora_models["refs"][name][1]


@pytest.mark.parametrize("name", ["llama-r8-f16", "qwen3-r8-bf16", "llama-r8-q8_0"])
def test_gguf_adapter_types_decode_as_gguf_py(lora_models, gguf_adapters, tmp_path, name):
    """f16 / bf16 / q8_0 (the converter keeps f16 where rows are not whole q8_0 blocks): the
    logits of a PEFT directory whose tensors gguf-py rounded to the type each GGUF tensor has,
    bit for bit."""
    import gguf
    from safetensors.numpy import save_file
    src = GGUF_ADAPTERS[name][0]
    base = lora_models["bases"][ADAPTERS[src][0]]
    arch = gguf.MODEL_ARCH.LLAMA if ADAPTERS[src][0] == "llama" else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(arch, json.loads((base / "config.json").read_text())["num_hidden_layers"])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(gguf_adapters[name])).tensors}
    d = tmp_path / "rounded"
    shutil.copytree(lora_models["adapters"][src], d)
    rounded = {}
    for key, value in read_safetensors(d / "adapter_model.safetensors").items():
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        qtype = types[names.get_name(module + ".weight", try_suffixes=(".weight",)) + ".lora_" + part[0].lower()]
        rounded[key] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
    written = {"f16": {"F16"}, "bf16": {"BF16"}, "q8_0": {"F16", "Q8_0"}}[GGUF_ADAPTERS[name][1]]
    assert {t.name for t in types.values()} == written
    save_file(rounded, str(d / "adapter_model.safetensors"))
    llm = llm_for(base)
    got = llm.score(PROMPT, lora_request=gguf_request(gguf_adapters, name))
    assert np.array_equal(got, llm.score(PROMPT, lora_request=LoRARequest("rounded", 200, str(d))))
    assert relative_gap(got, lora_models["refs"][src][0]) < 5e-2  # near the f32 adapter's


@pytest.fixture(scope="session")
def gguf_bases(lora_models, tmp_path_factory):
    """f32 GGUF bases of the same seed as the HF ones, for llama.cpp."""
    root = tmp_path_factory.mktemp("lora-gguf-bases")
    return {"llama": lora_models["gguf"],
            "qwen3-qk-norm": make_model("qwen3", "tiny", "gguf", "f32", seed=11, tokenizer=TOK,
                                        out=root / "qwen3.gguf")}


@pytest.mark.parametrize("name", ["llama-r8", "qwen3-r8"])
def test_llama_cpp_runs_the_gguf_adapter_as_ferrum(lora_models, gguf_adapters, gguf_bases, name):
    """llama.cpp (f32 KV) with the same GGUF adapter on the same f32 GGUF base: within 1e-5 of
    ferrum's logits relative to their scale, as without the adapter."""
    from llamacpp_scores import scores
    base = gguf_bases[ADAPTERS[name][0]]
    llm = llm_for(base)
    ours_base, ours = llm.score(PROMPT), llm.score(PROMPT, lora_request=gguf_request(gguf_adapters, name))
    assert relative_gap(ours, ours_base) > 1e-2  # the adapter matters
    assert relative_gap(ours_base, scores(base, PROMPT)) < 1e-5
    assert relative_gap(ours, scores(base, PROMPT, gguf_adapters[name])) < 1e-5


def _write_gguf(path, tensors, arch="llama", **fields):
    """An adapter GGUF written by gguf-py: `fields` over the converter's keys (None leaves one out);
    a tensor is an f32 array or (array, GGMLQuantizationType)."""
    import gguf
    keys = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 16.0}
    keys.update({k.replace("__", "."): v for k, v in fields.items()})
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in keys.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        elif v is not None:
            w.add_float32(k, v)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, gguf.quants.quantize(t[0], t[1]), raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _q4_0():
    import gguf
    return gguf.GGMLQuantizationType.Q4_0


QA, QB = "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b"
# name -> (tensors edit, fields for _write_gguf, the error's pattern)
BAD_GGUFS = {
    "a-model": (None, dict(general__type="model"), "general.type is 'model', not 'adapter'"),
    "no-type": (None, dict(general__type=None), "general.type is None"),
    "not-lora": (None, dict(adapter__type="control_vector"), "adapter.type 'control_vector' is not supported"),
    "other-arch": (None, dict(arch="qwen2"), "general.architecture is 'qwen2', but the base model is 'llama'"),
    "bad-alpha": (None, dict(adapter__lora__alpha=-1.0), "adapter.lora.alpha must be a non-negative number"),
    "nan-alpha": (None, dict(adapter__lora__alpha=float("nan")), "adapter.lora.alpha must be"),
    "alora": (None, dict(adapter__alora__invocation_tokens=[5, 6]), "aLoRA"),
    "missing": (_drop(QB), {}, f"missing tensor {QB}"),
    "unknown-layer": (_set("blk.9.attn_q.weight.lora_a", np.zeros((8, 64), np.float32)), {}, "does not have"),
    "norm": (_set("blk.0.attn_norm.weight", np.ones(64, np.float32)), {}, "unexpected tensor 'blk.0.attn_norm.weight'"),
    "embedding": (_set("token_embd.weight.lora_a", np.zeros((64, 8), np.float32)), {}, "embedding targets"),
    "lm-head": (_set("output.weight.lora_b", np.zeros((64, 8), np.float32)), {}, "lm_head targets"),
    "shape": (_set(QA, np.zeros((8, 65), np.float32)), {},
              rf"tensor {QA} is \[8, 65\], the base model needs \[8, 64\]"),
    "rank-mismatch": (_set(QA, np.zeros((4, 64), np.float32)), {}, rf"tensor {QA} is \[4, 64\]"),
    "nan": (_set(QB, np.full((64, 8), np.nan, np.float32)), {}, f"tensor {QB} has non-finite values"),
    "q4_0": (lambda t: {**t, QA: (t[QA], _q4_0())}, {}, f"tensor '{QA}' has type q4_0"),
    "no-tensors": (lambda t: {}, {}, "no lora_a / lora_b tensors"),
}


@pytest.mark.parametrize("case", list(BAD_GGUFS))
def test_bad_gguf_is_a_value_error(lora_models, gguf_adapters, tmp_path, case):
    import gguf
    edit, fields, match = BAD_GGUFS[case]
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(gguf_adapters["llama-r8"])).tensors}
    path = tmp_path / "adapter.gguf"
    _write_gguf(path, edit(tensors) if edit else tensors, **fields)
    llm = llm_for(lora_models["bases"]["llama"])
    with pytest.raises(ValueError, match=match):
        llm.score(PROMPT, lora_request=LoRARequest(case, 600 + list(BAD_GGUFS).index(case), str(path)))
    assert_close(llm.score(PROMPT), lora_models["refs"]["llama-r8"][2])  # the model goes on


def test_gguf_that_is_not_an_adapter(lora_models, gguf_adapters, tmp_path):
    llm = llm_for(lora_models["bases"]["llama"], max_lora_rank=4)
    with pytest.raises(ValueError, match="general.type"):  # a model
        llm.add_lora(LoRARequest("model", 700, str(lora_models["gguf"])))
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="x.gguf"):
        llm.add_lora(LoRARequest("junk", 701, str(tmp_path / "x.gguf")))
    with pytest.raises(ValueError, match="rank 8 is more than max_lora_rank 4"):
        llm.add_lora(gguf_request(gguf_adapters, "llama-r8"))


def test_damaged_gguf_adapter_is_refused_or_unchanged(lora_models, gguf_adapters, tmp_path):
    """One header field of the converter's file damaged (test_damaged_files' strategy): a
    ValueError, or the same updates (but for alpha 0, which llama.cpp reads as scale 1)."""
    from hypothesis import assume, given
    from test_damaged_files import PROPERTY, gguf_damage
    from ferrum import _core
    from ferrum.lora import cache_key, read_adapter
    cfg = llm_for(lora_models["bases"]["llama"]).config
    reference = cache_key(read_adapter(gguf_adapters["llama-r8"], cfg, 8))

    @PROPERTY
    @given(damaged=gguf_damage(gguf_adapters["llama-r8"].read_bytes()))
    def check(damaged):
        path = tmp_path / "damaged.gguf"
        path.write_bytes(damaged)
        try:
            updates = read_adapter(path, cfg, 8)
        except ValueError:
            return
        assume(_core.gguf_metadata(str(path)).get("adapter.lora.alpha") != 0)
        assert cache_key(updates) == reference
    check()
