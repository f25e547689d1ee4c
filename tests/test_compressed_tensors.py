"""compressed-tensors checkpoints (llm-compressor's pack-quantized format) written by the
compressed-tensors library itself, kept compressed by ferrum: its weights equal the library's own
decompression exactly, its logits match transformers running those weights in f32 (its greedy
tokens too, with generation's 8-bit activations), and files that do not fit their config are
refused by name.

llm-compressor pins an older transformers than the project's, so the checkpoints are written as
it writes them, by compressed-tensors' ModelCompressor, from min-max scales computed here (rounded
to f16 values, which ferrum's block types hold); the library packs the codes and the config."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ferrum
from q8_activations import greedy_both_ways
from test_gptq import _edited as edited_checkpoint
from conftest import MODELS
from ferrum.tools.make_model import make_model

TOK = f"{MODELS}/tokenizers/llama2"
SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=2,
             tie_word_embeddings=False)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 30000, 23)]
L0 = "model.layers.0.self_attn.q_proj"
O1 = "model.layers.1.self_attn.o_proj"
D0 = "model.layers.0.mlp.down_proj"  # the first packed module by name


def weights(bits, strategy, group_size=None, symmetric=True):
    return dict(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)


# name: (config_groups as {group: (targets, weights)}, ignore)
VARIANTS = {
    "w4a16-g32": ({"group_0": (["Linear"], weights(4, "group", 32))}, ["lm_head"]),
    "w4a16-asym-g128": ({"group_0": (["Linear"], weights(4, "group", 128, symmetric=False))}, ["lm_head"]),
    "w8a16-channel": ({"group_0": (["Linear"], weights(8, "channel"))}, ["lm_head"]),
    "w8a16-asym-g64": ({"group_0": (["Linear"], weights(8, "group", 64, symmetric=False))}, ["lm_head"]),
    # An exact name before a regex before the class; lm_head quantized too.
    "mixed": ({"attn": (["Linear"], weights(8, "group", 32)),
               "mlp": (["re:.*mlp\\.(gate|up)_proj$", "re:.*down_proj"], weights(4, "channel", symmetric=False)),
               "one": ([O1], weights(4, "group", 64))}, []),
}


def block_type(w):
    return "q8_0" if w.num_bits == 8 else "q4_0" if w.symmetric else "q5_0"


def write_checkpoint(src, out, groups, ignore):
    """src's float model quantized by compressed-tensors: the library attaches the schemes and
    packs; the scales and zero points are min-max ones, the scales rounded to f16 values."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={
        name: QuantizationScheme(targets=targets, weights=QuantizationArgs(**w))
        for name, (targets, w) in groups.items()}, ignore=ignore)
    apply_quantization_config(model, config, show_progress=False)
    for _, m in model.named_modules():
        args = getattr(m, "quantization_scheme", None)
        if args is None:
            continue
        args, w = args.weights, m.weight.data
        if args.strategy == "group":
            w = w.unflatten(-1, (-1, args.group_size))
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape).half().float())
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ct")
    src = make_model("llama", "tiny", "hf", "f32", seed=0, tokenizer=TOK, out=d / "float", **SHAPE)
    return {name: write_checkpoint(src, d / name, *v) for name, v in VARIANTS.items()}


def _float_model(path):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    return AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32)


def library_dequantized(path):
    """(every tensor as f32 with the packed modules decompressed by compressed-tensors'
    PackedQuantizationCompressor (the scales widened to f32 first), {module: its weights'
    QuantizationArgs}), the schemes matched to the modules by the library's own
    apply_quantization_config."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    model = _float_model(path)
    apply_quantization_config(model, config, show_progress=False)
    st = load_file(path / "model.safetensors")
    schemes = {n: m.quantization_scheme for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    out = {k: v.float() for k, v in st.items() if k.rsplit(".", 1)[0] not in schemes}
    for name, scheme in schemes.items():
        local = {k[len(name) + 1:]: v for k, v in st.items() if k.startswith(name + ".")}
        local["weight_scale"] = local["weight_scale"].float()  # exact; the products then are too
        out[name + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return out, {n: s.weights for n, s in schemes.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {name: library_dequantized(path) for name, path in checkpoints.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_equal_library_decompression(checkpoints, references, variant):
    mf = ferrum._core.ModelFile(str(checkpoints[variant]))
    ref, schemes = references[variant]
    lm_head_quantized = not VARIANTS[variant][1]
    assert len(schemes) == 7 * SHAPE["num_layers"] + lm_head_quantized
    for name, w in schemes.items():
        assert mf.tensors[name + ".weight"][0] == block_type(w), name
    assert mf.tensors["lm_head.weight"][0] == ("q8_0" if lm_head_quantized else "f32")
    for name in [k for k in ref if k.endswith("proj.weight") or k == "lm_head.weight"]:
        np.testing.assert_array_equal(mf.dequantized(name), ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f16_and_bf16_scales_read(checkpoints, tmp_path, dtype):
    """Scales stored as a f16 / bf16 model stores them: the f16 values exactly, or rounded to bf16
    (which f16 holds at these magnitudes); the reference decompresses the edited file."""
    def narrow(st):
        for k in [k for k in st if k.endswith(".weight_scale")]:
            st[k] = st[k].to(dtype)
    path = tmp_path / "narrow"
    _edited(checkpoints["w4a16-asym-g128"], path, tensors=narrow)
    mf = ferrum._core.ModelFile(str(path))
    ref, schemes = library_dequantized(path)
    for name in schemes:
        np.testing.assert_array_equal(mf.dequantized(name + ".weight"), ref[name + ".weight"].numpy(), err_msg=name)


def test_mixed_groups_matched_as_the_library_matches(references):
    schemes = references["mixed"][1]
    assert (schemes[O1].num_bits, schemes[O1].group_size) == (4, 64)  # its exact name beats "Linear"
    assert (schemes[L0].num_bits, schemes[L0].group_size) == (8, 32)
    assert not schemes["model.layers.0.mlp.down_proj"].symmetric


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_decompressed_weights(checkpoints, references, variant):
    path = checkpoints[variant]
    model = _float_model(path)
    model.load_state_dict(references[variant][0], strict=False)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    llm = ferrum.LLM(str(path), kv_dtype="f32", num_threads=2)
    got = llm.score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["w4a16-g32", "w4a16-asym-g128", "w8a16-asym-g64", "mixed"])
def test_greedy_tokens_match_transformers_with_8bit_activations(checkpoints, references, variant):
    """Generation's matmuls over quantized weights take Q8_0 activations (docs/evaluation.md):
    the reference rounds each quantized module's input the same way."""
    path = checkpoints[variant]
    model = _float_model(path)
    model.load_state_dict(references[variant][0], strict=False)
    want, got = greedy_both_ways(model, path, PROMPT, 8)
    assert got == want


def _edited(src, dst, config=None, group=None, tensors=None):
    """A copy of checkpoint src with its quantization_config updated by config and its first
    config group by group (the weights' fields into its "weights")."""
    q = json.loads((src / "config.json").read_text())["quantization_config"]
    q.update(config or {})
    for key, value in (group or {}).items():
        g = q["config_groups"]["group_0"]
        if key in ("num_bits", "strategy", "group_size", "symmetric", "type", "dynamic", "actorder"):
            g["weights"][key] = value
        else:
            g[key] = value
    return edited_checkpoint(src, dst, config=q, tensors=tensors)


def _set(name, value):
    return lambda st: st.__setitem__(name, value(st))


def _act_order(st):
    st[L0 + ".weight_g_idx"] = (torch.arange(128, dtype=torch.int32) // 32).flip(0).contiguous()


def _bad_g_idx(st):
    g = torch.arange(128, dtype=torch.int32) // 32
    g[5] = 9
    st[L0 + ".weight_g_idx"] = g


@pytest.mark.parametrize("edit, message", [
    (dict(config={"format": "float-quantized"}), "'format' is 'float-quantized'"),
    (dict(config={"format": "naive-quantized"}), "'format' is 'naive-quantized'"),
    (dict(group={"format": "int-quantized"}), "config_groups 'group_0' 'format' is 'int-quantized'"),
    (dict(config={"quantization_status": "frozen"}), "'quantization_status' is 'frozen'"),
    (dict(config={"kv_cache_scheme": {"num_bits": 8, "type": "float"}}), "'kv_cache_scheme' is set"),
    (dict(config={"transform_config": {"config_groups": {"u": {}}}}), "'transform_config' is set"),
    (dict(group={"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}),
     "'group_0' 'input_activations' is set (activation quantization)"),
    (dict(group={"num_bits": 3}), "'num_bits' is 3"),
    (dict(group={"type": "float"}), "'type' is 'float'"),
    (dict(group={"strategy": "tensor"}), "'strategy' is 'tensor'"),
    (dict(group={"strategy": "block"}), "'strategy' is 'block'"),
    (dict(group={"group_size": 16}), "'group_size' is 16"),
    (dict(group={"dynamic": "local"}), "'dynamic' is \"local\""),
    (dict(group={"actorder": "sometimes"}), "'actorder' is 'sometimes'"),
    (dict(group={"targets": ["re:(?P<x>.*)"]}), "'targets' entry 're:(?P<x>.*)' is not a regular expression"),
    (dict(group={"targets": ["re:.*mlp.*"]}), "'model.layers.0.self_attn.k_proj' is packed but no"),
    (dict(group={"targets": ["Linear", "Embedding"]}), "'targets' entry 'Embedding' names a module class"),
    (dict(config={"format": None}), "has no 'format'"),
    (dict(config={"ignore": ["lm_head", "re:.*q_proj"]}), f"'{L0}' is packed but"),
    (dict(config={"config_groups": {"a": {"targets": ["Linear"], "weights": weights(4, "group", 32)},
                                    "b": {"targets": ["Linear"], "weights": weights(4, "group", 32)}}}),
     "target 'Linear' is in both config_groups 'a' and 'b'"),
    (dict(group={"group_size": 64}), f"'{D0}.weight_scale' has shape [128, 8], expected [128, 4]"),
    (dict(group={"symmetric": False}), f"'{D0}.weight_zero_point' is missing"),
    (dict(tensors=_set(L0 + ".weight_packed", lambda st: st[L0 + ".weight_packed"][:, :-1].clone())),
     f"'{L0}.weight_packed' has shape [128, 15], expected [128, 16]"),
    (dict(tensors=_set(L0 + ".weight_shape", lambda st: torch.tensor([128, 96]))), f"'{L0}.weight_packed' has shape"),
    (dict(tensors=_set(L0 + ".weight_shape", lambda st: torch.tensor([128, 120]))), "multiple of 32"),
    (dict(tensors=_set(L0 + ".weight_scale", lambda st: st[L0 + ".weight_scale"] + 1e-4)),
     f"'{L0}.weight_scale' entry 0"),
    (dict(tensors=_set(L0 + ".weight_scale", lambda st: st[L0 + ".weight_scale"].to(torch.int32))),
     f"'{L0}.weight_scale' has dtype i32"),
    (dict(tensors=_set(L0 + ".weight_zero_point", lambda st: torch.zeros(16, 4, dtype=torch.int32))),
     f"'{L0}.weight_zero_point' is present but"),
    (dict(tensors=_set(L0 + ".weight", lambda st: torch.zeros(128, 128))), "both a float 'weight'"),
    (dict(tensors=lambda st: st.pop(L0 + ".weight_shape")), f"'{L0}.weight_shape' is missing"),
    (dict(tensors=lambda st: st.pop(L0 + ".weight_packed")), f"'{L0}.weight_scale' has no '{L0}.weight_packed'"),
    (dict(tensors=_act_order), f"'{L0}.weight_g_idx' orders inputs out of group order"),
    (dict(tensors=_bad_g_idx), f"'{L0}.weight_g_idx' entry 5 is 9"),
])
def test_bad_checkpoint_refused_by_name(checkpoints, tmp_path, edit, message):
    bad = _edited(checkpoints["w4a16-g32"], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        ferrum._core.ModelFile(bad)


def test_act_order_in_group_order_is_read(checkpoints, references, tmp_path):
    """An older file's weight_g_idx (actorder 'group') that keeps group order holds the same weights."""
    good = _edited(checkpoints["w4a16-g32"], tmp_path / "g_idx", group={"actorder": "group"},
                   tensors=_set(L0 + ".weight_g_idx", lambda st: torch.arange(128, dtype=torch.int32) // 32))
    np.testing.assert_array_equal(ferrum._core.ModelFile(good).dequantized(L0 + ".weight"),
                                  references["w4a16-g32"][0][L0 + ".weight"].numpy())


def test_mixed_precision_of_pack_quantized_groups_is_read(checkpoints, references, tmp_path):
    """format mixed-precision, as the library writes it when groups differ in format, is read when
    every group says pack-quantized."""
    good = _edited(checkpoints["mixed"], tmp_path / "mp", config={"format": "mixed-precision"})
    np.testing.assert_array_equal(ferrum._core.ModelFile(good).dequantized(O1 + ".weight"),
                                  references["mixed"][0][O1 + ".weight"].numpy())
    c = json.loads((tmp_path / "mp" / "config.json").read_text())
    groups = c["quantization_config"]["config_groups"]  # named group_<i> by the library
    mlp = next(name for name, g in groups.items() if "re:.*down_proj" in g["targets"])
    groups[mlp].pop("format")
    (tmp_path / "mp" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=re.escape(f"config_groups '{mlp}' 'format' is 'mixed-precision'")):
        ferrum._core.ModelFile(good)


def test_packed_tensors_without_config_refused(checkpoints, tmp_path):
    bad = tmp_path / "noconfig"
    shutil.copytree(checkpoints["w4a16-g32"], bad)
    c = json.loads((bad / "config.json").read_text())
    c.pop("quantization_config")
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=re.escape(".weight_packed' is packed (GPTQ / AWQ / compressed-tensors)")):
        ferrum._core.ModelFile(str(bad))


@pytest.mark.parametrize("kernels", ["cpu", "gpu"])
def test_opencl_matches_transformers(checkpoints, references, monkeypatch, kernels):
    """Every scheme of the mixed file on OpenCL, in both kernel families: scores as on the CPU."""
    monkeypatch.setenv("FERRUM_OPENCL_KERNELS", kernels)
    path = checkpoints["mixed"]
    model = _float_model(path)
    model.load_state_dict(references["mixed"][0], strict=False)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = ferrum.LLM(str(path), device="opencl", kv_dtype="f32").score(PROMPT)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
