"""Qwen3-MoE end to end: against transformers' own Qwen3MoeForCausalLM on generated models (HF
and GGUF layouts), llama.cpp on our GGUF, the batching engine, and bad files."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

import ferrum
from conftest import MODELS, SHARED, backend_names
from ferrum import _core
from ferrum.tools.make_model import make_model

TOK = f"{MODELS}/tokenizers/smollm2-135m-instruct"
LLAMACPP = os.path.join(SHARED, "bench", "llamacpp", "run.sh")
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 40000, 61)]
GREEDY = ferrum.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# tiny preset: hidden 64, 3 layers, 8 experts of width 32, top-2, norm_topk_prob on
VARIANTS = {
    "top2-norm": dict(),
    "top1-no-norm": dict(num_experts=16, num_experts_per_tok=1, norm_topk_prob=False),
    "top8-of-16-no-norm": dict(num_experts=16, num_experts_per_tok=8, norm_topk_prob=False),
    "top4-norm-mlp-only-layer": dict(num_experts=12, num_experts_per_tok=4, mlp_only_layers=(1,)),
    "sparse-step-2": dict(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,)),
}


def write(d, fmt, dtype="f32", **kw):
    out = d / ("hf" if fmt == "hf" else f"m-{dtype}.gguf")
    return make_model("qwen3_moe", "tiny", fmt, dtype, seed=3, tokenizer=TOK, out=out, **kw)


def router_counts(model, prompt):
    """Tokens per expert in each sparse layer, as transformers routes them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return [np.bincount(torch.topk(l.softmax(-1), k, -1).indices.flatten().numpy(),
                        minlength=model.config.num_experts) for l in logits]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    kw = VARIANTS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf, gguf = write(d, "hf", **kw), write(d, "gguf", **kw)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
        gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    return dict(hf=hf, gguf=gguf, ref=ref, greedy=gen.tolist(), counts=router_counts(model, PROMPT),
                config=model.config)


@pytest.mark.parametrize("device", backend_names())
@pytest.mark.parametrize("layout", ["hf", "gguf"])
def test_logits_and_greedy_match_transformers(variant, layout, device):
    llm = ferrum.LLM(str(variant[layout]), device=device, kv_dtype="f32", num_threads=2)
    cfg = variant["config"]
    sparse = [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers
              and (i + 1) % cfg.decoder_sparse_step == 0]
    assert llm.runner.config["moe_layers"] == sparse
    assert llm.runner.config["norm_topk_prob"] == cfg.norm_topk_prob
    got = llm.score(PROMPT)
    assert np.abs(got - variant["ref"]).max() < 1e-3
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    assert out[0].outputs[0].token_ids == variant["greedy"]


def test_opencl_equals_cpu(variant):
    """f32 experts: the backends differ only in summation order, so greedy continuations agree
    token for token over a batch of prompts, and logits closely (max |diff| measured 1.4e-4 ..
    6e-4 on logits spanning +-175, i.e. under 4e-6 relative; the bound is the one against
    transformers above)."""
    ps = [PROMPT] + prompts(5, seed=7)
    cpu, ocl = (ferrum.LLM(str(variant["gguf"]), device=d, kv_dtype="f32", num_threads=2) for d in ("cpu", "opencl"))
    assert greedy_tokens(ocl, ps) == greedy_tokens(cpu, ps)
    assert np.abs(ocl.score(PROMPT) - cpu.score(PROMPT)).max() < 1e-3


def test_generated_routing_is_uneven(variant):
    """The generator's routers spread tokens unevenly, as trained ones do: every sparse layer
    has popular and rare experts (so both the per-token and the grouped paths run)."""
    assert len(variant["counts"]) > 0
    for c in variant["counts"]:
        assert c.max() >= 3 * (c.min() + 1), c


@pytest.fixture(scope="module")
def moe_f32(tmp_path_factory):
    return write(tmp_path_factory.mktemp("moe-f32"), "hf", num_experts=16, num_experts_per_tok=2)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, 40000, rng.integers(1, 70))] for _ in range(n)]


def greedy_tokens(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]


@pytest.mark.parametrize("device", backend_names())
def test_batch_of_16_equals_alone(moe_f32, device):
    """Sequences routed together (tokens grouped by expert across sequences, chunked prefill)
    decode exactly as they do alone."""
    ps = prompts(16)
    alone_llm = ferrum.LLM(str(moe_f32), device=device, kv_dtype="f32", num_threads=2, enable_prefix_caching=False)
    alone = [greedy_tokens(alone_llm, [p])[0] for p in ps]
    for kw in (dict(), dict(max_num_batched_tokens=7)):
        llm = ferrum.LLM(str(moe_f32), device=device, kv_dtype="f32", num_threads=2, enable_prefix_caching=False,
                         **kw)
        assert greedy_tokens(llm, ps) == alone
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("device", backend_names())
def test_replay_equals_eager(moe_f32, device):
    llm = ferrum.LLM(str(moe_f32), device=device, kv_dtype="f32", num_threads=2)
    ps = prompts(4, seed=3)
    replayed = greedy_tokens(llm, ps)
    llm.runner.set_replay(False)
    assert greedy_tokens(llm, ps) == replayed


def test_scores_do_not_depend_on_chunking_or_batching(tmp_path):
    """A score's logits are the same bits however its sequence is chunked or batched: the
    experts' f32 GEMMs of a scoring step (quantized weights, an f16 KV cache) give each row the
    same result whatever rows share it."""
    model = str(write(tmp_path, "gguf", "q8_0", num_experts=4, num_experts_per_tok=2))
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 40000, 300)]
    alone = ferrum.LLM(model, num_threads=2, enable_prefix_caching=False)
    want = alone.score(ids)
    for budget in (7, 64, 129):
        llm = ferrum.LLM(model, num_threads=2, enable_prefix_caching=False, max_num_batched_tokens=budget)
        np.testing.assert_array_equal(llm.score(ids), want)
    for k in (1, 50, 170):
        np.testing.assert_array_equal(alone.score([ids[-k:], ids])[1], want)


def llamacpp(path, n_gen=8):
    env = dict(os.environ, PROMPT_TEXT="Once upon a time there was")
    out = subprocess.run(["bash", LLAMACPP, str(path), "16", str(n_gen), "2"], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_llamacpp_loads_our_gguf_and_agrees(tmp_path, dtype):
    """llama.cpp's qwen3moe (top-k renormalised, all layers sparse) runs our GGUF and decodes
    greedily as ferrum does on the same file, from llama.cpp's own prompt ids."""
    path = write(tmp_path, "gguf", dtype, num_experts=16, num_experts_per_tok=4, hidden_size=128,
                 moe_intermediate_size=64)
    res = llamacpp(path)
    assert len(res["generated_ids"]) == 8
    llm = ferrum.LLM(str(path), num_threads=2)
    out = llm.generate(prompt_token_ids=[res["prompt_ids"]],
                       sampling_params=ferrum.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == res["generated_ids"]


# --- bad files ----------------------------------------------------------------------------

@pytest.fixture
def hf_copy(tmp_path):
    """A fresh HF MoE directory to damage, and its tensors."""
    path = write(tmp_path, "hf")
    return path, load_file(str(path / "model.safetensors"))


def test_missing_expert_tensor(hf_copy):
    path, t = hf_copy
    del t["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        ferrum.LLM(str(path))


def test_missing_router(hf_copy):
    path, t = hf_copy
    del t["model.layers.0.mlp.gate.weight"]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight"):
        ferrum.LLM(str(path))


def test_misshaped_expert_tensor(hf_copy):
    path, t = hf_copy
    t["model.layers.2.mlp.experts.0.down_proj.weight"] = np.zeros((64, 48), np.float32)
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.weight' has shape \[64, 48\] but the config needs \[64, 32\]"):
        ferrum.LLM(str(path))


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(moe_intermediate_size=48), "config needs"),  # tensors no longer match the config
])
def test_bad_moe_config(hf_copy, change, message):
    path, _ = hf_copy
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        ferrum.LLM(str(path))


def test_gguf_expert_width_disagreeing_with_tensors(tmp_path):
    path = write(tmp_path, "gguf")
    data = path.read_bytes()
    key = b"qwen3moe.expert_feed_forward_length"
    at = data.index(key) + len(key)
    assert data[at:at + 8] == (4).to_bytes(4, "little") + (32).to_bytes(4, "little")  # u32 32
    path.write_bytes(data[:at + 4] + (48).to_bytes(4, "little") + data[at + 8:])
    with pytest.raises(ValueError, match=r"ffn_gate_exps\.weight' has shape \[8, 32, 64\] but the config needs \[8, 48, 64\]"):
        ferrum.LLM(str(path))


def test_cli_writes_moe_config(tmp_path, capsys):
    from ferrum.tools.make_model import main
    out = tmp_path / "cli"
    assert main(["--arch", "qwen3_moe", "--vocab-size", "300", "--num-experts", "6", "--num-experts-per-tok", "3",
                 "--moe-intermediate-size", "64", "--no-norm-topk-prob", "--mlp-only-layers", "0,2",
                 "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == (["Qwen3MoeForCausalLM"], 6, 3, 64, False, [0, 2])
    assert _core.ModelRunner(str(out)).config["moe_layers"] == [1]  # no tokenizer: the runner alone
