"""Quantized Qwen3-MoE checkpoints: GPTQ and AWQ written by GPTQModel itself (quantizing a
generated model on CPU, experts included, the router left in float as it leaves it), and
compressed-tensors pack-quantized W4A16 and asymmetric W8A16 written by the compressed-tensors
library. ferrum keeps the experts quantized (stacked into the [E, out, in] block-type tensors its
MoE kernels read; asymmetric 8-bit ones as Q8_0 plus their group offsets) and
the router as stored: its expert weights equal each library's own dequantization exactly, its
logits match transformers running those weights in f32, its greedy tokens match with generation's
8-bit activations, and experts that do not fit are refused by name."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ferrum
from q8_activations import greedy_both_ways
from test_awq import _gemm_dequantized
from test_gptq import TOK, _edited, library_dequantized as gptq_dequantized, quantize_with_gptqmodel
from ferrum.tools.make_model import make_model

# GPTQModel's Qwen3-MoE definition expects experts in every layer: no mlp_only_layers.
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
E, LAYERS = SHAPE["num_experts"], SHAPE["num_layers"]
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 30000, 23)]
# GPTQModel stores the embedding and norms in bf16: layer 0's inputs, of few mantissa bits, often
# land exactly on a rounding boundary of the 8-bit activations (x / d = k + 1/2), which an ulp of
# difference in the norm then decides either way. With this prompt (seed 15) none of the greedy
# test's variants has one (its closest input is 2 ulps away), so the reference can follow ferrum.
GREEDY_PROMPT = [int(t) for t in np.random.default_rng(15).integers(10, 30000, 23)]
EXPERT0 = "model.layers.0.mlp.experts"
# name: (GPTQModel QuantizeConfig keywords, quantize() keywords)
GPTQMODEL_JOBS = {
    "gptq-sym4-g32": (dict(bits=4, group_size=32, sym=True, desc_act=False, format="gptq"), {}),
    "gptq-asym4-g64-v2": (dict(bits=4, group_size=64, sym=False, desc_act=False, format="gptq_v2"), {}),
    "gptq-act-order": (dict(bits=4, group_size=32, sym=False, desc_act=True, format="gptq"), {}),
    "awq-asym-g32": (dict(method="awq", bits=4, group_size=32, sym=False, format="gemm"), dict(backend="awq_torch")),
}
CT = "ct-w4a16-g32"
CT_ASYM8 = "ct-w8a16-asym-g32"  # Q8_0 holding s (q - 128), the rest as group offsets
# name -> the block type ferrum holds its experts in.
VARIANTS = {"gptq-sym4-g32": "q4_0", "gptq-asym4-g64-v2": "q5_0", "awq-asym-g32": "q5_0", CT: "q4_0",
            CT_ASYM8: "q8_0", "gptq-act-order": "q5_0"}


def compressed_tensors_modules(st):
    """The checkpoint's matrices (all but the embedding) as nn.Linear modules under their own
    names: transformers holds the experts fused as 3-D parameters, which compressed-tensors'
    "Linear" target does not match (llm-compressor unfuses them into per-expert Linear modules
    before it quantizes)."""
    root = torch.nn.Module()
    for name, w in st.items():
        if w.ndim != 2 or not name.endswith(".weight") or name == "model.embed_tokens.weight":
            continue
        *path, leaf = name[:-len(".weight")].split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.float()
        parent.add_module(leaf, linear)
    return root


def ct_config(bits=4, symmetric=True):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=32)
    # llm-compressor's MoE recipes leave the router (mlp.gate) and the head in float.
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                              ignore=["lm_head", "re:.*mlp\\.gate$"])


def write_compressed_tensors(src, out, config):
    """src's float model packed by compressed-tensors from min-max scales rounded to f16 values
    (as tests/test_compressed_tensors.py writes dense ones)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    st = load_file(src / "model.safetensors")
    modules = compressed_tensors_modules(st)
    apply_quantization_config(modules, config, show_progress=False)
    for _, m in modules.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w = m.weight.data.unflatten(-1, (-1, scheme.weights.group_size))
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), scheme.weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape).half().float())
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(modules, "pack-quantized")
    compressor.compress_model(modules)
    out.mkdir()
    packed = {k: v.contiguous() for k, v in modules.state_dict().items()}
    save_file({**{k: v for k, v in st.items() if k not in packed and k.rsplit(".", 1)[0] not in dict(modules.named_modules())},
               **packed}, out / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    compressor.update_config(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-quant")
    src = make_model("qwen3_moe", "tiny", "hf", "f32", seed=3, tokenizer=TOK, out=d / "float", **SHAPE)
    paths = quantize_with_gptqmodel(d, GPTQMODEL_JOBS, src=src)
    paths[CT] = write_compressed_tensors(src, d / CT, ct_config())
    paths[CT_ASYM8] = write_compressed_tensors(src, d / CT_ASYM8, ct_config(bits=8, symmetric=False))
    return paths


def ct_dequantized(path):
    """The checkpoint's tensors as f32, the packed modules decompressed by compressed-tensors'
    PackedQuantizationCompressor (the scales widened to f32 first, exactly), the schemes matched
    by the library's apply_quantization_config from the file's own config."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    st = load_file(path / "model.safetensors")
    float_shapes = {k[:-len(".weight_shape")] + ".weight": torch.zeros(v.tolist()) for k, v in st.items()
                    if k.endswith(".weight_shape")}
    modules = compressed_tensors_modules({**st, **float_shapes})
    apply_quantization_config(modules, config, show_progress=False)
    schemes = {n: m.quantization_scheme for n, m in modules.named_modules() if hasattr(m, "quantization_scheme")}
    out = {k: v.float() for k, v in st.items() if k.rsplit(".", 1)[0] not in schemes}
    for name, scheme in schemes.items():
        local = {k[len(name) + 1:]: v for k, v in st.items() if k.startswith(name + ".")}
        local["weight_scale"] = local["weight_scale"].float()
        out[name + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return out


def library_dequantized(checkpoints, variant):
    path = checkpoints[variant]
    if variant in (CT, CT_ASYM8):
        return ct_dequantized(path)
    if variant.startswith("awq"):
        return _gemm_dequantized(load_file(path / "model.safetensors"),
                                 json.loads((path / "config.json").read_text())["quantization_config"])
    return gptq_dequantized(path)


@pytest.fixture(scope="module")
def references(checkpoints):
    return {v: library_dequantized(checkpoints, v) for v in VARIANTS}


def transformers_on(path, weights):
    """transformers' Qwen3-MoE in f32 with the checkpoint's config (its quantization_config
    dropped) and these per-expert weights, stacked into its fused experts."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=torch.float32)
    sd = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for i in range(LAYERS):
        x = f"model.layers.{i}.mlp.experts"
        sd[x + ".gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{x}.{e}.gate_proj.weight"], weights[f"{x}.{e}.up_proj.weight"]]) for e in range(E)])
        sd[x + ".down_proj"] = torch.stack([weights[f"{x}.{e}.down_proj.weight"] for e in range(E)])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied head
    return model


def expert_names(layer):
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down")]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_expert_weights_equal_library_dequantization(checkpoints, references, variant):
    mf = ferrum._core.ModelFile(str(checkpoints[variant]))
    ref = references[variant]
    for layer in range(LAYERS):
        for name in expert_names(layer):
            assert mf.tensors[name][0] == VARIANTS[variant], name
            np.testing.assert_array_equal(mf.dequantized(name), ref[name].numpy(), err_msg=name)
            order = mf.input_order(name)  # act-order: each expert's own
            assert order is None if variant != "gptq-act-order" else sorted(order) == list(range(len(order))), name
        router = f"model.layers.{layer}.mlp.gate.weight"  # as stored: bf16 (GPTQModel's CPU dtype) or f32
        stored = load_file(checkpoints[variant] / "model.safetensors")[router]
        assert mf.tensors[router][0] == {torch.bfloat16: "bf16", torch.float32: "f32"}[stored.dtype]
        np.testing.assert_array_equal(mf.dequantized(router), stored.float().numpy())


@pytest.mark.parametrize("device", ["cpu", "opencl"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_dequantized_weights(checkpoints, references, variant, device):
    path = checkpoints[variant]
    model = transformers_on(path, references[variant])
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(path), device=device, kv_dtype="f32", num_threads=2).score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_asymmetric_8bit_experts_on_the_gpu_kernel_family(checkpoints, references, monkeypatch):
    """The gpu family runs moe_experts' matmuls with its own kernels; the experts' group
    offsets ride on them alike."""
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", "gpu")
    path = checkpoints[CT_ASYM8]
    with torch.no_grad():
        ref = transformers_on(path, references[CT_ASYM8])(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(path), device="opencl", kv_dtype="f32").score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["gptq-sym4-g32", "awq-asym-g32", CT, CT_ASYM8, "gptq-act-order"])
def test_greedy_tokens_match_transformers_with_8bit_activations(checkpoints, references, variant):
    """Generation's quantized matmuls, the experts' included, take Q8_0 activations: the
    reference rounds each quantized module's and each expert's inputs the same way."""
    path = checkpoints[variant]
    want, got = greedy_both_ways(transformers_on(path, references[variant]), path, GREEDY_PROMPT, 12)
    assert got == want


def _drop(module):
    return lambda st: [st.pop(k) for k in [k for k in st if k.startswith(module + ".")]]


def _narrow(module, rows):
    """module's GPTQ tensors for its first `rows` outputs only."""
    def edit(st):
        for k, pf in ((".qweight", 1), (".qzeros", 8), (".scales", 1)):
            st[module + k] = st[module + k][:, :rows // pf].clone()
    return edit


def _float_expert(module, float_src):
    def edit(st):
        _drop(module)(st)
        st[module + ".weight"] = load_file(float_src / "model.safetensors")[module + ".weight"]
    return edit


@pytest.mark.parametrize("edit, message", [
    (lambda d: _drop(f"{EXPERT0}.3.down_proj"), f"missing tensor '{EXPERT0}.3.down_proj.weight'"),
    (lambda d: _narrow(f"{EXPERT0}.2.up_proj", 32),
     f"tensor '{EXPERT0}.2.up_proj.weight' has shape [32, 128] but the config needs [64, 128]"),
])
def test_bad_expert_refused_by_name(checkpoints, tmp_path, edit, message):
    path = checkpoints["gptq-sym4-g32"]
    bad = _edited(path, tmp_path / "bad", tensors=edit(path))
    with pytest.raises(ValueError, match=re.escape(message)):
        ferrum._core.ModelFile(bad)


def test_expert_left_in_float_refused_by_name(checkpoints, tmp_path):
    """The MoE kernels read one type for all experts of a projection."""
    path = checkpoints["gptq-sym4-g32"]
    bad = _edited(path, tmp_path / "bad", tensors=_float_expert(f"{EXPERT0}.1.gate_proj", path.parent / "float"))
    with pytest.raises(ValueError, match=re.escape(f"experts of '{EXPERT0}.1.gate_proj.weight' differ in dtype")):
        ferrum.LLM(bad, num_threads=1)


def test_act_order_experts_read_their_own_orders(checkpoints):
    """GPTQModel's desc_act orders each expert's inputs on its own: the experts of a layer hold
    different orders, which moe_experts applies expert by expert."""
    mf = ferrum._core.ModelFile(str(checkpoints["gptq-act-order"]))
    orders = [tuple(mf.input_order(f"{EXPERT0}.{e}.gate_proj.weight")) for e in range(E)]
    assert len(set(orders)) == E and all(o != tuple(sorted(o)) for o in orders)
    for e in range(E):  # gate and up read one input: GPTQModel gives them one order
        assert mf.input_order(f"{EXPERT0}.{e}.up_proj.weight") == list(orders[e])


TP_SCRIPT = """
import json, sys
import numpy as np
import ferrum
path, act_order, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    ferrum.LLM(act_order, tensor_parallel_size=2)
    refused = ""
except ValueError as e:
    refused = str(e)
two = ferrum.LLM(path, tensor_parallel_size=2, kv_dtype="f32", num_threads=1).score(prompt)
one = ferrum.LLM(path, kv_dtype="f32", num_threads=1).score(prompt)
print(json.dumps([refused, float(np.abs(two - one).max() / np.abs(one).max())]))
"""


def test_experts_under_tensor_parallelism(checkpoints):
    """Two ranks (LLM starts the second) split each expert's gate / up offsets with its rows and
    down's group sums with its input blocks: the logits of one process. An act-order file's o_proj
    (and its experts' down_proj) would need inputs from the other rank's share: refused by name
    on every rank, and the next model loads."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(checkpoints[CT_ASYM8]), str(checkpoints["gptq-act-order"]),
                        json.dumps(PROMPT)], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    refused, error = json.loads(p.stdout.strip().splitlines()[-1])
    assert "'model.layers.0.self_attn.o_proj.weight' orders its inputs (GPTQ act-order), which tensor parallelism" in refused
    assert error <= 1e-5
