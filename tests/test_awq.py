"""AWQ checkpoints written by GPTQModel itself (AWQ-quantizing a generated model on CPU; the gemv
layout packed by GPTQModel's own gemv packer from the same codes, as its gemv quantization needs
CUDA), kept compressed by ferrum: its weights equal GPTQModel's own AWQ dequantization exactly,
its logits match transformers running those dequantized weights in f32 (its greedy tokens
transformers with activations rounded to 8 bits as ferrum's quantized matmuls round them), and
files that do not fit their config are refused by name."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ferrum
from q8_activations import greedy_both_ways
from test_gptq import PROMPT, SHAPE, _edited, gptqmodel_imports, quantize_with_gptqmodel, transformers_on

# name: (group_size, sym) of a gemm checkpoint GPTQModel writes -> the block type ferrum holds it in.
GEMM = {
    "asym-g64": (64, False, "q5_0"),
    "sym-g32": (32, True, "q4_0"),
    "asym-g-1": (-1, False, "q5_0"),
}
GEMV = "asym-g64-gemv"  # asym-g64's codes in the gemv layout (GPTQModel packs gemv groups of 64 and 128)
NOT_CONVERTED = "asym-g64-down-float"  # asym-g64 with down_proj kept float (modules_to_not_convert)
VARIANTS = {**{n: v[2] for n, v in GEMM.items()}, GEMV: "q5_0", NOT_CONVERTED: "q5_0"}
PACKED = (".qweight", ".qzeros", ".scales")
L0 = "model.layers.0.self_attn.q_proj"


def _gemm_dequantized(st, q):
    """The checkpoint's tensors as f32, its gemm modules dequantized by GPTQModel's own AWQ
    dequantization (scales widened to f32 first, exactly)."""
    with gptqmodel_imports():
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    out = {k: v.float() for k, v in st.items() if not k.endswith(PACKED)}
    for name in [k[:-len(".qweight")] for k in st if k.endswith(".qweight")]:
        K = st[name + ".qweight"].shape[0]
        group = K if q["group_size"] == -1 else q["group_size"]
        w = dequantize_gemm(st[name + ".qweight"], st[name + ".qzeros"], st[name + ".scales"].float(), q["bits"], group)
        out[name + ".weight"] = w.T.float().contiguous()
    return out


def _config(path):
    return json.loads((path / "config.json").read_text())


def _set_config(path, **fields):
    for f in ("config.json", "quantize_config.json"):
        c = json.loads((path / f).read_text())
        (c["quantization_config"] if f == "config.json" else c).update(fields)
        (path / f).write_text(json.dumps(c))


def _write_gemv(src, dst):
    """src (gemm) repacked by GPTQModel's gemv packer: the same codes, zeros and scales."""
    with gptqmodel_imports():
        from gptqmodel.nn_modules.qlinear.gemv_awq import AwqGEMVLinear
        from gptqmodel.quantization.awq.utils.packing_utils import reverse_awq_order, unpack_awq
    shutil.copytree(src, dst)
    q = _config(src)["quantization_config"]
    st = load_file(src / "model.safetensors")
    weights = _gemm_dequantized(st, q)
    for name in [k[:-len(".qweight")] for k in st if k.endswith(".qweight")]:
        N, K = weights[name + ".weight"].shape
        group = K if q["group_size"] == -1 else q["group_size"]
        _, zeros = reverse_awq_order(*unpack_awq(st[name + ".qweight"], st[name + ".qzeros"], 4, N), 4)
        linear = torch.nn.Linear(K, N, bias=False)
        linear.weight.data = weights[name + ".weight"]
        m = AwqGEMVLinear(bits=4, group_size=group, sym=False, desc_act=False, in_features=K, out_features=N)
        m.pack(linear, st[name + ".scales"].float().T.contiguous(), zeros.T.contiguous())
        for k in PACKED:
            st[name + k] = getattr(m, k[1:]).contiguous()
    save_file(st, dst / "model.safetensors", metadata={"format": "pt"})
    _set_config(dst, version="gemv", format="gemv", checkpoint_format="gemv")


def _write_not_converted(src, dst, float_weights):
    """src with every down_proj stored as the float model's weight, listed in modules_to_not_convert."""
    shutil.copytree(src, dst)
    st = load_file(src / "model.safetensors")
    for name in [k[:-len(".qweight")] for k in st if k.endswith("down_proj.qweight")]:
        for k in PACKED:
            st.pop(name + k)
        st[name + ".weight"] = float_weights[name + ".weight"]
    save_file(st, dst / "model.safetensors", metadata={"format": "pt"})
    _set_config(dst, modules_to_not_convert=["down_proj"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("awq")
    jobs = {name: (dict(method="awq", bits=4, group_size=group, sym=sym, format="gemm"), dict(backend="awq_torch"))
            for name, (group, sym, _) in GEMM.items()}
    paths = quantize_with_gptqmodel(d, jobs)
    _write_gemv(paths["asym-g64"], d / GEMV)
    _write_not_converted(paths["asym-g64"], d / NOT_CONVERTED, load_file(d / "float" / "model.safetensors"))
    return {**paths, GEMV: d / GEMV, NOT_CONVERTED: d / NOT_CONVERTED}


def library_dequantized(checkpoints, variant):
    """The variant's weights as GPTQModel dequantizes them (the gemv one's are its gemm source's)."""
    path = checkpoints["asym-g64" if variant == GEMV else variant]
    return _gemm_dequantized(load_file(path / "model.safetensors"), _config(path)["quantization_config"])


def test_checkpoints_are_what_gptqmodel_writes(checkpoints):
    q = _config(checkpoints["asym-g64"])["quantization_config"]
    assert (q["quant_method"], q["version"], q["zero_point"], q["bits"], q["group_size"]) == ("awq", "gemm", True, 4, 64)
    assert _config(checkpoints["sym-g32"])["quantization_config"]["zero_point"] is False
    st = load_file(checkpoints["asym-g64"] / "model.safetensors")
    # GPTQModel keeps the model's dtype (bf16 on CPU) for the scales.
    assert st[L0 + ".qweight"].shape == (128, 16) and st[L0 + ".scales"].shape == (2, 128)
    assert st[L0 + ".scales"].dtype == torch.bfloat16
    gemv = load_file(checkpoints[GEMV] / "model.safetensors")
    # gemv zeros are padded to 2 words for groups of 64, scales to 8 per word.
    assert gemv[L0 + ".qweight"].shape == (128, 16) and gemv[L0 + ".qzeros"].shape == (128, 2)
    assert gemv[L0 + ".scales"].shape == (128, 16)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_equal_gptqmodel_dequantization(checkpoints, variant):
    mf = ferrum._core.ModelFile(str(checkpoints[variant]))
    ref = library_dequantized(checkpoints, variant)
    linear = [k for k in ref if k.endswith("proj.weight")]
    assert len(linear) == 7 * SHAPE["num_layers"]
    for name in linear:
        kept_float = variant == NOT_CONVERTED and "down_proj" in name
        assert mf.tensors[name][0] == ("f32" if kept_float else VARIANTS[variant]), name
        np.testing.assert_array_equal(mf.dequantized(name), ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_dequantized_weights(checkpoints, variant):
    model = transformers_on(checkpoints[variant], library_dequantized(checkpoints, variant))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    llm = ferrum.LLM(str(checkpoints[variant]), kv_dtype="f32", num_threads=2)
    got = llm.score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["asym-g64", GEMV, "sym-g32"])
def test_greedy_tokens_match_transformers_with_8bit_activations(checkpoints, variant):
    """Generation's matmuls over quantized weights take Q8_0 activations (as llama.cpp's do),
    which turns near ties of this random model: the reference rounds each quantized module's
    input the same way."""
    model = transformers_on(checkpoints[variant], library_dequantized(checkpoints, variant))
    want, got = greedy_both_ways(model, checkpoints[variant], PROMPT, 12)
    assert got == want


def _set_tensor(name, value):
    return lambda st: st.__setitem__(name, value(st[name]))


def _tiny_bf16_scale(st):
    s = st[L0 + ".scales"].clone()
    s[0, 3] = 1e-30
    st[L0 + ".scales"] = s


@pytest.mark.parametrize("variant, edit, message", [
    ("asym-g64", dict(config={"version": "marlin", "format": "marlin", "checkpoint_format": "marlin"}),
     "AWQ version 'marlin' is not supported"),
    ("asym-g64", dict(config={"version": "gemv"}), "'version' is 'gemv' but 'format' is 'gemm'"),
    ("asym-g64", dict(config={"bits": 8}), "'bits' is 8: ferrum reads 4-bit AWQ only"),
    ("asym-g64", dict(config={"group_size": 16}), "'group_size' is 16"),
    ("asym-g64", dict(config={"group_size": 32}), ".down_proj.scales' has shape [4, 128], expected [8, 128]"),
    ("asym-g64", dict(config={"backend": "llm-awq"}), "'backend' is 'llm-awq'"),
    ("asym-g64", dict(config={"zero_point": "yes"}), "'zero_point' must be true or false"),
    ("asym-g64", dict(config={"dynamic": {"-:.*down_proj.*": {}}}), "'dynamic'"),
    ("asym-g64", dict(config={"modules_to_not_convert": ["q_proj"]}), f"module '{L0}' is AWQ-packed but"),
    ("asym-g64", dict(config={"modules_to_not_convert": ["model.layers.1"]}), "lists it ('model.layers.1')"),
    ("asym-g64", dict(tensors=_set_tensor(L0 + ".qzeros", lambda t: t[:, :-1].clone())), f"'{L0}.qzeros' has shape"),
    ("asym-g64", dict(tensors=lambda st: st.pop(L0 + ".scales")), f"'{L0}.scales' is missing"),
    ("asym-g64", dict(tensors=_set_tensor(L0 + ".scales", lambda t: t.float())), f"'{L0}.scales' has dtype f32"),
    ("asym-g64", dict(tensors=lambda st: st.__setitem__(L0 + ".g_idx", torch.zeros(128, dtype=torch.int32))),
     "has a 'g_idx' beside its 'qweight'"),
    ("asym-g64", dict(tensors=_tiny_bf16_scale), f"'{L0}.scales' entry 3"),
    (GEMV, dict(config={"group_size": 96}), "the gemv version packs groups of 32, 64 or at least 128 only"),
    (GEMV, dict(tensors=_set_tensor(L0 + ".scales", lambda t: t[:, :8].clone())), f"'{L0}.scales' has shape [128, 8]"),
])
def test_bad_checkpoint_refused_by_name(checkpoints, tmp_path, variant, edit, message):
    bad = _edited(checkpoints[variant], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        ferrum._core.ModelFile(bad)


def test_autoawq_quant_config_json_is_read(checkpoints, tmp_path):
    """AutoAWQ's own quant_config.json (its names: w_bit, q_group_size, version in capitals)."""
    d = tmp_path / "autoawq"
    shutil.copytree(checkpoints["asym-g64"], d)
    c = _config(d)
    c.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(c))
    (d / "quantize_config.json").unlink()
    (d / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4,
                                                     "version": "GEMM"}))
    mf = ferrum._core.ModelFile(str(d))
    ref = library_dequantized(checkpoints, "asym-g64")
    np.testing.assert_array_equal(mf.dequantized(L0 + ".weight"), ref[L0 + ".weight"].numpy())


@pytest.mark.parametrize("kernels", ["cpu", "gpu"])
def test_opencl_matches_transformers(checkpoints, monkeypatch, kernels):
    """The repacked blocks on OpenCL, in both kernel families: scores as on the CPU."""
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", kernels)
    variant = "asym-g64"
    model = transformers_on(checkpoints[variant], library_dequantized(checkpoints, variant))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(checkpoints[variant]), device="opencl", kv_dtype="f32").score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
