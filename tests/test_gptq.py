"""GPTQ checkpoints written by GPTQModel itself (quantizing a generated model on CPU), kept
compressed by ferrum: its weights equal GPTQModel's own dequantization exactly, its logits match
transformers running those dequantized weights in f32, and files that do not fit their config
are refused by name."""
import contextlib
import json
import re
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ferrum
from q8_activations import greedy_both_ways
from conftest import MODELS
from ferrum.tools.make_model import make_model

TOK = f"{MODELS}/tokenizers/llama2"
SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=2)
# name: (bits, group_size, sym, checkpoint format) -> the block type ferrum holds it in.
VARIANTS = {
    "sym4-g32-v1": (4, 32, True, "gptq", "q4_0"),
    "asym4-g64-v2": (4, 64, False, "gptq_v2", "q5_0"),
    "asym4-g32-v1-act-order": (4, 32, False, "gptq", "q5_0"),
    "sym4-g32-dynamic": (4, 32, True, "gptq", "q4_0"),
    # q8_0 holding s (q - 128), the zeros' s (128 - z) beside it
    "asym8-g128-v2": (8, 128, False, "gptq_v2", "q8_0"),
    "asym8-g64-v1-act-order": (8, 64, False, "gptq", "q8_0"),
}
ACT_ORDER = {"asym4-g32-v1-act-order", "asym8-g64-v1-act-order"}  # desc_act: GPTQModel quantizes the inputs in another order
# GPTQModel's per-module overrides: the first matching pattern in the file's order decides ("-:"
# leaves it in float); sorted, "+:" would come first and make layer 1's down_proj 8-bit too
DYNAMIC = {"sym4-g32-dynamic": {r".*\.1\.mlp\.down_proj": {"bits": 4}, r"-:.*\.1\.self_attn\.o_proj": {},
                                r"+:.*down_proj": {"bits": 8, "group_size": 64}}}
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 30000, 23)]

QUANTIZE = textwrap.dedent("""
    import json, sys
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer
    src, jobs = sys.argv[1], json.loads(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(src)
    texts = ["Once upon a time there was a little girl who lived in a village near the forest.",
             "The quick brown fox jumps over the lazy dog, again and again, until it was tired."] * 4
    calib = [dict(tok(t)) for t in texts]
    for out, (config, quantize) in jobs.items():
        m = GPTQModel.load(src, QuantizeConfig(**config))
        m.quantize(calib, batch_size=1, **quantize)
        m.save(out)
""")


def quantize_with_gptqmodel(d, jobs, src=None):
    """A float model (src, or a generated Llama under d/float), quantized by GPTQModel on CPU into
    each job's directory: jobs maps a name to (QuantizeConfig keywords, quantize() keywords)."""
    src = src or make_model("llama", "tiny", "hf", "f32", seed=0, tokenizer=TOK, out=d / "float", **SHAPE)
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-c", QUANTIZE, str(src), json.dumps({str(d / n): j for n, j in jobs.items()})],
                   check=True, env=env, cwd=d, stdout=subprocess.DEVNULL)
    return {name: d / name for name in jobs}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    jobs = {name: (dict(bits=bits, group_size=group, sym=sym, desc_act=name in ACT_ORDER, format=fmt,
                        dynamic=DYNAMIC.get(name)), {})
            for name, (bits, group, sym, fmt, _) in VARIANTS.items()}
    return quantize_with_gptqmodel(tmp_path_factory.mktemp("gptq"), jobs)


@contextlib.contextmanager
def gptqmodel_imports():
    """GPTQModel's tokenizer package sets the hub's cache variables for the whole process on
    import (later tests read the hub cache from them): put them back."""
    cache_vars = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")
    before = {k: os.environ.get(k) for k in cache_vars}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def library_dequantized(path):
    """Every tensor of the checkpoint as f32, the quantized modules dequantized by GPTQModel's own
    torch kernel (v1 zeros converted by its own v1 -> v2 step; scales widened to f32 first, exactly)."""
    with gptqmodel_imports():
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear
        from gptqmodel.quantization.config import dynamic_get
        from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    st = load_file(path / "model.safetensors")
    out = {k: v.float() for k, v in st.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for name in [k[:-len(".qweight")] for k in st if k.endswith(".qweight")]:
        K, N = st[name + ".g_idx"].shape[0], st[name + ".scales"].shape[1]
        bits, group = (dynamic_get(q.get("dynamic"), name, k, q[k]) for k in ("bits", "group_size"))
        m = TorchLinear(bits=bits, group_size=group, sym=q["sym"], desc_act=q["desc_act"],
                        in_features=K, out_features=N, bias=False, pack_dtype=torch.int32)
        for k in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(m, k).data.copy_(st[f"{name}.{k}"])
        if q["checkpoint_format"] == "gptq":
            convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
        m.scales.data = m.scales.data.float()
        m.post_init()
        out[name + ".weight"] = m.dequantize_weight().T.float().contiguous()
    return out


def transformers_on(path, weights):
    """transformers' Llama in f32 with the checkpoint's config (its quantization_config dropped)
    and these weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_equal_gptqmodel_dequantization(checkpoints, variant):
    path = checkpoints[variant]
    mf = ferrum._core.ModelFile(str(path))
    ref = library_dequantized(path)
    stored = load_file(path / "model.safetensors")
    quantized = [k for k in ref if k.endswith("proj.weight")]
    assert len(quantized) == 7 * SHAPE["num_layers"]
    for name in quantized:
        qweight = stored.get(name[:-len(".weight")] + ".qweight")  # [K * bits / 32, N]
        bits = 32 * qweight.shape[0] // ref[name].shape[1] if qweight is not None else 0  # 0: left in float
        as_stored = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}.get(stored.get(name, torch.tensor(0)).dtype)
        assert mf.tensors[name][0] == (VARIANTS[variant][4] if bits == 4 else "q8_0" if bits == 8 else as_stored), name
        np.testing.assert_array_equal(mf.dequantized(name), ref[name].numpy(), err_msg=name)
        order = mf.input_order(name)
        if variant not in ACT_ORDER:
            assert order is None, name
            continue
        # the columns hold the inputs grouped by g_idx, each group in its inputs' order
        g_idx = stored[name[:-len(".weight")] + ".g_idx"].numpy()
        assert sorted(order) == list(range(len(order))) and order != sorted(order), name
        assert list(g_idx[order]) == sorted(g_idx), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_dequantized_weights(checkpoints, variant):
    path = checkpoints[variant]
    model = transformers_on(path, library_dequantized(path))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    llm = ferrum.LLM(str(path), kv_dtype="f32", num_threads=2)
    got = llm.score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["sym4-g32-v1", "asym4-g32-v1-act-order", "asym8-g64-v1-act-order"])
def test_greedy_tokens_match_transformers_with_8bit_activations(checkpoints, variant):
    """Generation's matmuls take Q8_0 activations (act-order: of the reordered inputs), which
    turns near ties of this random model: the reference rounds each module's input the same way."""
    path = checkpoints[variant]
    want, got = greedy_both_ways(transformers_on(path, library_dequantized(path)), path, PROMPT, 12)
    assert got == want


def _edited(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        c["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(c))
    if tensors:
        st = load_file(dst / "model.safetensors")
        tensors(st)
        save_file(st, dst / "model.safetensors")
    return str(dst)


L0 = "model.layers.0.self_attn.q_proj"


def _uneven_g_idx(st):
    """Act-order whose group 0 holds 33 inputs: not whole 32-input blocks."""
    st[L0 + ".g_idx"] = st[L0 + ".g_idx"].flip(0).clone()
    st[L0 + ".g_idx"][0] = 0


def _bad_g_idx(st):
    st[L0 + ".g_idx"] = st[L0 + ".g_idx"].clone()
    st[L0 + ".g_idx"][5] = 99


@pytest.mark.parametrize("edit, message", [
    (dict(config={"quant_method": "compressed-tensors"}), "'quant_method' is 'compressed-tensors'"),
    (dict(config={"checkpoint_format": "marlin"}), "checkpoint format 'marlin'"),
    (dict(config={"bits": 3}), "'bits' is 3"),
    (dict(config={"group_size": 16}), "'group_size' is 16"),
    (dict(config={"dynamic": {"-:.*down_proj.*": {}}}), "'dynamic' rule '-:.*down_proj.*' leaves it unquantized"),
    (dict(config={"dynamic": {".*down_proj": {"bits": 3}}}), "'dynamic' rule '.*down_proj': 'bits' is 3"),
    (dict(config={"dynamic": {"+:(": {}}}), "'dynamic' pattern '+:(' is not a regular expression"),
    (dict(config={"group_size": 64}), ".scales' has shape [8, 128], expected [4, 128]"),
    (dict(tensors=lambda st: st.__setitem__(L0 + ".qzeros", st[L0 + ".qzeros"][:, :-1].clone())),
     f"'{L0}.qzeros' has shape"),
    (dict(tensors=_bad_g_idx), f"'{L0}.g_idx' entry 5 is 99"),
    (dict(tensors=_uneven_g_idx), f"'{L0}.g_idx' puts 33 inputs in group 0, not a multiple of 32"),
    (dict(tensors=lambda st: st.pop(L0 + ".scales")), f"'{L0}.scales' is missing"),
])
def test_bad_checkpoint_refused_by_name(checkpoints, tmp_path, edit, message):
    bad = _edited(checkpoints["sym4-g32-v1"], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        ferrum._core.ModelFile(bad)


@pytest.mark.parametrize("kernels", ["cpu", "gpu"])
@pytest.mark.parametrize("variant", ["asym4-g32-v1-act-order", "asym8-g64-v1-act-order"])
def test_act_order_on_opencl_matches_transformers(checkpoints, monkeypatch, kernels, variant):
    """The reordered inputs gathered by OpenCL's kernel (both families share it) before the
    quantized matmul, and the 8-bit zeros' group sums added after it, in either family: scores
    as on the CPU."""
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", kernels)
    path = checkpoints[variant]
    model = transformers_on(path, library_dequantized(path))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(path), device="opencl", kv_dtype="f32").score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


TP_SCRIPT = """
import json, sys
import numpy as np
import ferrum
plains, act_order, prompt = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
out = {"relative_error": {}}
try:
    ferrum.LLM(act_order, tensor_parallel_size=2)
except ValueError as e:
    out["refused"] = str(e)
for plain in plains:
    two = ferrum.LLM(plain, tensor_parallel_size=2, kv_dtype="f32", num_threads=1).score(prompt)
    one = ferrum.LLM(plain, kv_dtype="f32", num_threads=1).score(prompt)
    out["relative_error"][plain] = float(np.abs(two - one).max() / np.abs(one).max())
print(json.dumps(out))
"""


def test_tensor_parallelism(checkpoints):
    """Two ranks (LLM starts the second) split the translated blocks as a GGUF's, and 8-bit
    zeros' offsets with the rows or the blocks they belong to: the logits of one process. An
    act-order o_proj / down_proj would need inputs from the other rank's share: refused by name,
    on every rank, and the next model loads."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    plains = [str(checkpoints[v]) for v in ("asym4-g64-v2", "asym8-g128-v2")]
    p = subprocess.run([sys.executable, "-c", TP_SCRIPT, json.dumps(plains),
                        str(checkpoints["asym4-g32-v1-act-order"]), json.dumps(PROMPT)],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "o_proj.weight' orders its inputs (GPTQ act-order), which tensor parallelism" in out["refused"]
    assert all(e <= 1e-5 for e in out["relative_error"].values()), out


def test_sharded_checkpoint_loads_as_one_file(checkpoints, tmp_path):
    """The same tensors in two shards with an index (a module's qweight in one, its scales and
    zeros in the other): the same weights and scores, bit for bit."""
    src = checkpoints["asym4-g64-v2"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    st = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    shards = ({}, {})
    for k, v in st.items():
        shards[int(k.endswith((".scales", ".qzeros")) or "norm" in k)][k] = v
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard, name in zip(shards, names):
        save_file(shard, dst / name, metadata={"format": "pt"})
    weight_map = {k: name for shard, name in zip(shards, names) for k in shard}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    one, two = ferrum._core.ModelFile(str(src)), ferrum._core.ModelFile(str(dst))
    assert np.array_equal(two.dequantized(L0 + ".weight"), one.dequantized(L0 + ".weight"))
    score = lambda p: ferrum.LLM(str(p), kv_dtype="f32", num_threads=2).score(PROMPT)
    assert np.array_equal(score(dst), score(src))


def test_fused_parts_grouped_differently(checkpoints, tmp_path):
    """q/k/v fused with k's groups halved by a `dynamic` rule (its second half's zeros moved by
    one): the fused projection's offsets fall back to one group per block, and the scores still
    match transformers on GPTQModel's dequantization of the file."""
    src = checkpoints["asym8-g128-v2"]

    def regroup(st):
        for i in range(SHAPE["num_layers"]):
            k = f"model.layers.{i}.self_attn.k_proj"
            st[k + ".scales"] = st[k + ".scales"].repeat_interleave(2, 0).contiguous()
            zeros = st[k + ".qzeros"].repeat_interleave(2, 0)
            assert all(((zeros[1] >> (8 * j)) & 255).max() < 255 for j in range(4))  # no byte carries
            zeros[1] += 0x01010101
            st[k + ".qzeros"] = zeros.contiguous()
            st[k + ".g_idx"] = (torch.arange(st[k + ".g_idx"].shape[0], dtype=torch.int32) // 64).contiguous()

    path = tmp_path / "regrouped"
    _edited(src, path, config={"dynamic": {r"+:.*k_proj": {"group_size": 64}}}, tensors=regroup)
    ref = library_dequantized(path)
    mf = ferrum._core.ModelFile(str(path))
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        np.testing.assert_array_equal(mf.dequantized(name), ref[name].numpy(), err_msg=name)
    with torch.no_grad():
        want = transformers_on(path, ref)(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(path), kv_dtype="f32", num_threads=2).score(PROMPT)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
