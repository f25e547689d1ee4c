"""Rung 4: every architecture variant against Hugging Face transformers' own implementation,
on random-weight models the generator writes (f32). Logits at every position within 1e-3 and
identical greedy tokens; HF and GGUF layouts of the same weights agree."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ferrum
from conftest import MODELS
from ferrum.tools.make_model import make_model

TOK = f"{MODELS}/tokenizers/smollm2-135m-instruct"
VARIANTS = {
    "llama3-rope-scaling": dict(arch="llama", rope_scaling="llama3", max_position_embeddings=512),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2-bias": dict(arch="qwen2"),
    "qwen3-qk-norm": dict(arch="qwen3"),
    "mistral-window": dict(arch="mistral", sliding_window=24),
}
# A prompt longer than Mistral's window, straddling KV blocks.
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 40000, 61)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    kw = dict(VARIANTS[request.param])
    arch = kw.pop("arch")
    d = tmp_path_factory.mktemp(request.param)
    hf = make_model(arch, "tiny", "hf", "f32", seed=3, tokenizer=TOK, out=d / "hf", **kw)
    gguf = make_model(arch, "tiny", "gguf", "f32", seed=3, tokenizer=TOK, out=d / "m.gguf", **kw)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
        gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    return hf, gguf, ref, gen.tolist()


@pytest.mark.parametrize("device", ["cpu", "opencl"])
@pytest.mark.parametrize("layout", ["hf", "gguf"])
def test_logits_and_greedy_match_transformers(variant, layout, device):
    hf, gguf, ref, greedy = variant
    llm = ferrum.LLM(str(hf if layout == "hf" else gguf), device=device, kv_dtype="f32", num_threads=2)
    got = llm.score(PROMPT)
    assert np.abs(got - ref).max() < 1e-3
    out = llm.generate(prompt_token_ids=[PROMPT],
                       sampling_params=ferrum.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy
