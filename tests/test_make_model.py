"""The test-model generator: quantizer bit layouts, HF and GGUF outputs, and agreement of
transformers (HF dir and GGUF) and llama.cpp on the generated models."""
import hashlib
import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from ferrum.tools import quantize as Q
from ferrum.tools.gguf_weights import read_gguf_model
from ferrum.tools.gguf_writer import gguf_name, permute_for_interleaved_rope, tensor_type
from ferrum.tools.make_model import from_dequantized, main, make_config, make_model
from ferrum.tools.tokenizer_files import add_vocab_to_gguf, load_tokenizer
from ferrum.tools.weights import random_source, tensor_specs

SHARED = Path(os.environ.get("FERRUM_SHARED", Path(__file__).resolve().parents[2] / "shared"))
TOKENIZERS = SHARED / "models" / "tokenizers"
LLAMACPP = SHARED / "bench" / "llamacpp" / "run.sh"
TOKENIZER_OF = {"llama": TOKENIZERS / "llama3", "qwen2": TOKENIZERS / "qwen3-0.6b",
                "qwen3": TOKENIZERS / "qwen3-0.6b", "mistral": TOKENIZERS / "mistral-7b-v0.1"}
ARCHS = list(TOKENIZER_OF)
PROMPTS = [[1, 500, 2000, 33, 7, 900, 1200, 45, 46, 47, 3000, 12, 13, 14, 15, 16],
           [17, 17, 17, 17, 17, 17, 17, 17], [29000, 2, 310, 8, 9000, 4, 77, 31000, 5]]
# f16 scale fields of each block type, for layout checks on random bytes
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
              "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
              "iq4_nl": [0], "iq4_xs": [0]}
# relative RMS error of quantize -> dequantize on Gaussian data (this round-to-nearest
# quantizer; llama-quantize's scale search does a little better on k-quants)
RMSE_BOUND = {"q8_0": 0.007, "q4_0": 0.1, "q4_1": 0.09, "q5_0": 0.05, "q5_1": 0.045,
              "q2_k": 0.36, "q3_k": 0.18, "q4_k": 0.09, "q5_k": 0.045, "q6_k": 0.022,
              "iq4_nl": 0.09, "iq4_xs": 0.095}


def _ggml(t):
    return gguf.GGMLQuantizationType[t.upper()]


def _dir_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_logits(model, ids)[-1].argmax()))
    return ids[-n:]


def _load_hf(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _load_gguf(path: Path, **kw):
    return _load_hf(path.parent, gguf_file=path.name, **kw)


def _llamacpp(path: Path, prompt: str = "Once upon a time there was", n_gen: int = 8) -> dict:
    env = dict(os.environ, PROMPT_TEXT=prompt)
    out = subprocess.run(["bash", str(LLAMACPP), str(path), "16", str(n_gen), "2"], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Lazily written tiny models, shared by the tests: models(arch, format, dtype, **kw).
    Tests that don't exercise the tokenizer use no tokenizer or the small SentencePiece one:
    reading a GGUF that embeds a 150k-token BPE vocabulary takes gguf-py seconds."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch, format="hf", dtype="f32", seed=7, tokenizer="default", **overrides):
        tokenizer = TOKENIZER_OF[arch] if tokenizer == "default" else tokenizer
        key = json.dumps([arch, format, dtype, seed, str(tokenizer), overrides], sort_keys=True)
        if key not in cache:
            name = f"{arch}-{dtype}-{seed}-{len(cache)}" + (".gguf" if format == "gguf" else "")
            cache[key] = make_model(arch=arch, preset="tiny", format=format, dtype=dtype,
                                    seed=seed, tokenizer=tokenizer, out=root / name,
                                    **overrides)
        return cache[key]
    return get


# --- quantizers ----------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", Q.QUANT_TYPES)
def test_dequantize_equals_gguf_py(qtype):
    """Our dequantizer equals gguf-py's (an independent reading of ggml's layouts) on our own
    blocks and on random bytes, so every bit of every field is placed the same way."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 512), dtype=np.float32)
    ours = Q.quantize(x, qtype)
    np.testing.assert_array_equal(Q.dequantize(ours, qtype), gguf.quants.dequantize(ours, _ggml(qtype)))

    block, nbytes = Q.BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, (64, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:  # finite scales, so NaN != NaN can't hide a mismatch
        raw[:, off:off + 2] = rng.uniform(-1, 1, (64, 1)).astype(np.float16).view(np.uint8)
    np.testing.assert_array_equal(Q.dequantize(raw, qtype), gguf.quants.dequantize(raw, _ggml(qtype)))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_bytes_equal_gguf_py(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 256), dtype=np.float32) * rng.uniform(0.01, 10, (32, 1)).astype(np.float32)
    x[3] = 0  # an all-zero block must give d = 0, not NaN
    np.testing.assert_array_equal(Q.quantize(x, qtype), gguf.quants.quantize(x, _ggml(qtype)))


@pytest.mark.parametrize("qtype", Q.QUANT_TYPES)
def test_quantization_error_within_bound(qtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 1024), dtype=np.float32)
    y = Q.dequantize(Q.quantize(x, qtype), qtype)
    assert y.shape == x.shape
    rel_rmse = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel_rmse < RMSE_BOUND[qtype]
    if qtype in ("q4_0", "q5_0", "q8_0", "q4_1", "q5_1"):
        # per block: round-to-nearest is within one step (half a step, except where the
        # symmetric types clamp the top code), plus f16 rounding of the scale
        blocks, err = x.reshape(-1, 32), np.abs(y - x).reshape(-1, 32)
        amax, span = np.abs(blocks).max(1), blocks.max(1) - blocks.min(1)
        step = {"q4_0": amax / 8, "q5_0": amax / 16, "q8_0": amax / 127 / 2,
                "q4_1": span / 15 / 2, "q5_1": span / 31 / 2}[qtype]
        assert np.all(err.max(1) <= step * 1.01 + 1e-3 * amax)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.5, 1e-40, np.inf], np.float32)
    back = Q.bf16_bits_to_float(Q.float_to_bf16_bits(x))
    np.testing.assert_array_equal(back, torch.tensor(x).bfloat16().float().numpy())


# --- presets --------------------------------------------------------------------------------

def test_real_presets_follow_the_checkpoints():
    qwen = TOKENIZERS / "qwen3-0.6b"
    c = make_config("qwen2", "qwen2.5-0.5b", qwen)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size,
            c.vocab_size, c.attention_bias, c.tie_word_embeddings, c.rope_theta) == (
        896, 24, 14, 2, 4864, 151936, True, True, 1e6)  # vocab padded past the 151669 tokens
    c = make_config("qwen3", "qwen3-0.6b", qwen)
    assert (c.head_dim, c.q_size, c.qk_norm, c.num_kv_heads) == (128, 2048, True, 8)
    c = make_config("llama", "smollm2-135m", TOKENIZERS / "smollm2-135m-instruct")
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, c.rope_theta) == (
        576, 9, 3, 49152, 1e5)
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    # 576-long rows can't hold 256-element k-quant blocks: llama.cpp's fallbacks apply
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "q4_k_m", c) == "q5_0"
    assert tensor_type("token_embd.weight", (49152, 576), "q4_k_m", c) == "q8_0"
    assert tensor_type("blk.0.ffn_down.weight", (576, 1536), "q4_k_m", c) == "q6_k"
    c = make_config("llama", "tinyllama-1.1b", TOKENIZERS / "llama2" / "tokenizer.model")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size,
            c.vocab_size, c.tie_word_embeddings) == (2048, 22, 32, 4, 5632, 32000, False)
    with pytest.raises(ValueError):
        make_config("qwen2", "tiny", qwen, attention_bias=False)


# --- HF output -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_with_peaked_logits(models, arch):
    path = models(arch)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[arch]]
    model = _load_hf(path)
    assert type(model).__name__ == cfg["architectures"][0]
    assert model.config.rope_parameters["rope_theta"] == cfg["rope_theta"]
    for ids in PROMPTS:
        logits = _logits(model, ids)
        assert np.isfinite(logits).all()
        top2 = np.sort(logits, axis=-1)[:, -2:]
        # f32 logits are good to ~1e-4 here; a gap far above that keeps greedy decoding stable
        assert (top2[:, 1] - top2[:, 0]).min() > 0.02, "near-tie: greedy decoding would be fragile"
        assert logits.std() > 16
    # the prediction depends on the context, not only on the current token
    with torch.no_grad():
        last = model(torch.tensor([[5, 6, t, 100] for t in range(200, 210)])).logits[:, -1]
    assert len(set(last.argmax(-1).tolist())) > 3


def test_hf_is_deterministic(models, tmp_path):
    a = models("qwen3")
    b = make_model(arch="qwen3", preset="tiny", format="hf", seed=7,
                   tokenizer=TOKENIZER_OF["qwen3"], out=tmp_path / "again")
    c = make_model(arch="qwen3", preset="tiny", format="hf", seed=8,
                   tokenizer=TOKENIZER_OF["qwen3"], out=tmp_path / "other")
    assert _dir_hash(a) == _dir_hash(b) != _dir_hash(c)
    assert (a / "tokenizer.json").read_bytes() == (TOKENIZER_OF["qwen3"] / "tokenizer.json").read_bytes()


def test_hf_sharded_equals_single_file(models, tmp_path):
    single = models("llama")
    sharded = make_model(arch="llama", preset="tiny", format="hf", seed=7, tokenizer=TOKENIZER_OF["llama"],
                         out=tmp_path / "sharded", shard_bytes=4_000_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    np.testing.assert_array_equal(_logits(_load_hf(single), PROMPTS[0]),
                                  _logits(_load_hf(sharded), PROMPTS[0]))


def test_hf_half_precision_dtypes(tmp_path):
    for dtype in ("f16", "bf16"):
        path = make_model(arch="llama", preset="tiny", format="hf", dtype=dtype, seed=7,
                          tokenizer=TOKENIZER_OF["llama"], out=tmp_path / dtype, num_layers=1)
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        assert np.isfinite(_logits(model.float(), PROMPTS[1])).all()


def test_hf_mistral_sliding_window(models):
    """config.json's sliding_window reaches HF Mistral: positions within the window are
    unchanged, later ones see less context."""
    spm = TOKENIZER_OF["mistral"]
    windowed = _logits(_load_hf(models("mistral", tokenizer=spm, sliding_window=4)), PROMPTS[0])
    full = _logits(_load_hf(models("mistral", tokenizer=spm)), PROMPTS[0])
    np.testing.assert_allclose(windowed[:4], full[:4], atol=1e-4)
    assert np.abs(windowed[8:] - full[8:]).max() > 1.0


# --- GGUF output ---------------------------------------------------------------------------

def test_gguf_metadata_and_tensors(models):
    spm = TOKENIZER_OF["mistral"]
    path = models("qwen3", "gguf", "q4_k_m", tokenizer=spm, hidden_size=256,
                  intermediate_size=512, num_layers=8, head_dim=32)
    cfg = make_config("qwen3", "tiny", spm, hidden_size=256, intermediate_size=512, num_layers=8,
                      head_dim=32)
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    expect = {"general.architecture": "qwen3", "general.file_type": 15,
              "qwen3.embedding_length": 256, "qwen3.block_count": 8,
              "qwen3.feed_forward_length": 512, "qwen3.attention.head_count": 4,
              "qwen3.attention.head_count_kv": 2, "qwen3.attention.key_length": 32,
              "qwen3.attention.value_length": 32, "qwen3.rope.freq_base": 10000.0,
              "qwen3.rope.dimension_count": 32, "qwen3.context_length": 2048,
              "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1,
              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True}
    for k, v in expect.items():
        assert meta[k] == pytest.approx(v), k
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.scores"]) == 32000
    assert meta["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert meta["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6]  # unknown, control x2, byte

    source = random_source(cfg, 7)
    tensors = {t.name: t for t in r.tensors}
    specs = tensor_specs(cfg)
    assert set(tensors) == {gguf_name(n) for n, _ in specs}
    assert "output.weight" not in tensors  # tied
    seen = set()
    for hf_name, shape in specs:
        t = tensors[gguf_name(hf_name)]
        assert tuple(int(d) for d in t.shape[::-1]) == shape
        ttype = t.tensor_type.name.lower()
        assert ttype == tensor_type(t.name, shape, "q4_k_m", cfg)
        seen.add(ttype)
        x = source(hf_name)
        if ttype == "f32":
            np.testing.assert_array_equal(np.asarray(t.data).reshape(shape), x)
            continue
        y = Q.dequantize(np.asarray(t.data).reshape(shape[0], -1), ttype)
        rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
        assert rel < RMSE_BOUND[ttype], (t.name, ttype, rel)
    assert seen == {"f32", "q4_k", "q6_k", "q5_0"}  # q5_0: attn_output rows are 128 long
    # llama.cpp's Q4_K_M rule: Q6_K for the tied embedding, attn_v / ffn_down of layers 0 and
    # 7 (first and last eighth) and every third layer between (here 3 and 6)
    q6 = sorted(n for n, t in tensors.items() if t.tensor_type.name == "Q6_K")
    assert q6 == sorted(["token_embd.weight"] + [f"blk.{i}.{w}.weight" for i in (0, 3, 6, 7)
                                                   for w in ("attn_v", "ffn_down")])


def test_k_quant_fallback_for_short_rows():
    cfg = make_config("llama", "tiny", TOKENIZER_OF["llama"])  # hidden 64, intermediate 172
    assert tensor_type("blk.0.attn_q.weight", (64, 64), "q4_k", cfg) == "q5_0"
    assert tensor_type("blk.0.attn_q.weight", (64, 64), "q6_k", cfg) == "q8_0"
    assert tensor_type("blk.0.ffn_down.weight", (64, 172), "q4_k", cfg) == "f16"
    assert tensor_type("blk.0.attn_norm.weight", (64,), "q4_k", cfg) == "f32"


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_equals_hf_in_transformers(models, arch):
    """transformers reads our f32 GGUF (undoing the llama q/k permutation itself) and must
    compute exactly what it computes from the HF directory of the same seed."""
    kw = dict(tokenizer=None, vocab_size=32000)
    hf = _load_hf(models(arch, **kw))
    # transformers' GGUF reader has no qwen3 head_dim key mapping; pass it
    extra = {"head_dim": hf.config.head_dim} if arch == "qwen3" else {}
    from_gguf = _load_gguf(models(arch, "gguf", **kw), **extra)
    for ids in PROMPTS:
        np.testing.assert_allclose(_logits(from_gguf, ids), _logits(hf, ids), rtol=0, atol=1e-4)


def test_permutation_is_the_interleaved_rope_layout():
    """Rotating HF's (i, i + d/2) pairs equals rotating the permuted rows' (2i, 2i+1) pairs."""
    rng = np.random.default_rng(3)
    heads, d = 3, 8
    w = rng.standard_normal((heads * d, 5))
    perm = permute_for_interleaved_rope(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            np.testing.assert_array_equal(perm[h * d + 2 * i], w[h * d + i])
            np.testing.assert_array_equal(perm[h * d + 2 * i + 1], w[h * d + i + d // 2])


def test_from_dequantized_requantizes(models, tmp_path):
    hf = models("llama")
    weights = load_file(hf / "model.safetensors")
    cfg = make_config("llama", "tiny", TOKENIZER_OF["llama"])
    same = from_dequantized(weights, cfg, format="hf", dtype="f32", out=tmp_path / "hf",
                            tokenizer=TOKENIZER_OF["llama"])
    assert (same / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    q8 = from_dequantized(weights, cfg, format="gguf", dtype="q8_0", out=tmp_path / "q8.gguf")
    t = {t.name: t for t in gguf.GGUFReader(q8).tensors}["blk.1.attn_q.weight"]
    assert t.tensor_type.name == "Q8_0"
    x = permute_for_interleaved_rope(weights["model.layers.1.self_attn.q_proj.weight"], 4)
    y = Q.dequantize(np.asarray(t.data).reshape(64, -1), "q8_0")
    assert np.abs(y - x).max() < np.abs(x).max() / 127
    with pytest.raises(ValueError, match="missing"):
        from_dequantized({}, cfg, out=tmp_path / "bad.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_read_gguf_model_round_trip(models, arch):
    """A GGUF read back to HF-layout float weights (the input of from_dequantized) gives the
    generating weights exactly: q/k un-permuted, names and config recovered."""
    kw = dict(tokenizer=None, vocab_size=1000, tie_word_embeddings=arch == "qwen2")
    path = models(arch, "gguf", **kw)
    cfg, weights = read_gguf_model(path)
    expected = make_config(arch, "tiny", **kw)
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias"):
        assert getattr(cfg, field) == getattr(expected, field), field
    source = random_source(expected, 7)
    assert set(weights) == {n for n, _ in tensor_specs(expected)}
    for name, x in weights.items():
        np.testing.assert_array_equal(x, source(name), err_msg=name)


def test_cli_writes_gguf(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["--arch", "mistral", "--preset", "tiny", "--format", "gguf", "--dtype", "q8_0",
                 "--seed", "3", "--tokenizer", str(TOKENIZER_OF["mistral"]), "--out", str(out),
                 "--no-tie", "--sliding-window", "8", "--num-layers", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    r = gguf.GGUFReader(out)
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.sliding_window"] == 8
    assert meta["tokenizer.ggml.model"] == "llama" and len(meta["tokenizer.ggml.scores"]) == 32000
    assert {t.name for t in r.tensors} >= {"output.weight", "blk.1.ffn_down.weight"}


class _RecordingWriter:
    """Stands in for gguf.GGUFWriter: records add_* calls (reading back a GGUF that embeds a
    150k-token BPE vocabulary takes gguf-py many seconds; llama.cpp's runs below read them)."""
    def __init__(self):
        self.kv = {}

    def __getattr__(self, name):
        if not name.startswith("add_"):
            raise AttributeError(name)
        return lambda value: self.kv.__setitem__(name[4:], value)


@pytest.mark.parametrize("tokenizer, pre, n_vocab, n_merges, bos, eos, template", [
    ("llama3", "llama-bpe", 128256, 280147, 128000, 128001, True),
    ("qwen3-0.6b", "qwen2", 151936, 151387, 151643, 151645, True),
    ("smollm2-135m-instruct", "smollm", 49152, 48900, 1, 2, False),
])
def test_bpe_vocabulary_for_gguf(tokenizer, pre, n_vocab, n_merges, bos, eos, template):
    info = load_tokenizer(TOKENIZERS / tokenizer)
    w = _RecordingWriter()
    add_vocab_to_gguf(w, info, n_vocab)
    kv = w.kv
    assert kv["tokenizer_model"] == "gpt2" and kv["tokenizer_pre"] == pre
    assert len(kv["token_list"]) == len(kv["token_types"]) == n_vocab
    assert len(kv["token_merges"]) == n_merges
    assert (kv["bos_token_id"], kv["eos_token_id"]) == (bos, eos)
    assert ("chat_template" in kv) == template
    types = dict(zip(kv["token_list"], kv["token_types"]))
    special = {"llama3": "<|begin_of_text|>", "qwen3-0.6b": "<|im_end|>",
               "smollm2-135m-instruct": "<|im_start|>"}[tokenizer]
    assert types[special] == 3 and types[kv["token_list"][1000]] == 1  # control, normal
    if n_vocab > info.size:  # padded like llama.cpp's converter: unused placeholders
        assert kv["token_list"][-1] == f"[PAD{n_vocab - 1}]" and kv["token_types"][-1] == 5


# --- llama.cpp -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_llamacpp_greedy_equals_transformers(models, arch):
    """llama.cpp loads our f32 GGUF (its tokenizer too) and decodes greedily exactly as
    transformers does on the HF directory of the same seed, from llama.cpp's prompt ids."""
    text = "Once upon a time there was"
    res = _llamacpp(models(arch, "gguf"), prompt=text)
    assert len(res["generated_ids"]) == 8
    assert _greedy(_load_hf(models(arch)), res["prompt_ids"], 8) == res["generated_ids"]
    if arch != "mistral":  # the embedded BPE vocabulary tokenizes as HF's tokenizer.json does
        hf_ids = Tokenizer.from_file(str(TOKENIZER_OF[arch] / "tokenizer.json")).encode(
            text, add_special_tokens=False).ids
        bos = [128000] if arch == "llama" else []  # llama-bpe adds BOS, qwen2 doesn't
        assert res["prompt_ids"] == bos + hf_ids


def test_llamacpp_llama3_rope_scaling(models):
    """rope_freqs.weight makes llama.cpp apply HF's llama3 frequency scaling."""
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    spm = TOKENIZER_OF["mistral"]
    hf = _load_hf(models("llama", tokenizer=spm, rope_scaling=scaling))
    plain = _load_hf(models("llama", tokenizer=spm))
    assert np.abs(_logits(hf, PROMPTS[0]) - _logits(plain, PROMPTS[0])).max() > 1.0
    path = models("llama", "gguf", tokenizer=spm, rope_scaling=scaling)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    res = _llamacpp(path, prompt="Once upon a time there was a little dog who liked to run")
    assert _greedy(hf, res["prompt_ids"], 8) == res["generated_ids"]


@pytest.mark.parametrize("dtype", ["q4_k_m", "iq4_xs", "iq4_nl"])
def test_llamacpp_reads_our_k_and_iq4_quants(models, dtype):
    """llama.cpp decodes our k-quant and IQ4 blocks as transformers (through gguf-py) does.
    llama.cpp multiplies with 8-bit quantized activations, so its greedy path may leave
    transformers' after a few tokens; at every step of its path its choice must still be
    transformers' best token up to that rounding (a misread block would give a token far from
    the top)."""
    path = models("qwen3", "gguf", dtype, tokenizer=TOKENIZER_OF["mistral"], hidden_size=256,
                  intermediate_size=512, num_layers=4)
    res = _llamacpp(path)
    prompt, gen = res["prompt_ids"], res["generated_ids"]
    assert len(gen) == 8
    logits = _logits(_load_gguf(path, head_dim=64), prompt + gen)[len(prompt) - 1:-1]
    assert int(logits[0].argmax()) == gen[0]
    shortfall = logits.max(axis=1) - logits[np.arange(8), gen]
    assert shortfall.max() < 0.05 * logits.std(), shortfall


@pytest.mark.parametrize("dtype", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"])
def test_ferrum_generates_from_k_quant_files_as_transformers_reads_them(models, dtype):
    """ferrum's generation path on every k-quant (prefill int8 GEMM, decode in the CPU's R16
    layouts: 256-wide rows, whole groups of 16) and IQ4 type (their row kernels, dequantized
    tiles for prefill) against transformers on the weights gguf-py dequantizes. ferrum's activations are 8-bit in every matmul, so its greedy path may leave
    transformers' after a few tokens; at every step its choice must be transformers' best token
    up to that rounding (a misread block or a wrong kernel lands far from the top)."""
    import ferrum
    path = models("qwen3", "gguf", dtype, tokenizer=TOKENIZER_OF["mistral"], hidden_size=256,
                  intermediate_size=512, num_layers=4)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name.endswith("ffn_up.weight")} == {dtype.upper()}
    llm = ferrum.LLM(str(path), num_threads=2)
    prompt = llm.tokenizer.encode("Once upon a time there was")
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=ferrum.SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    logits = _logits(_load_gguf(path, head_dim=64), prompt + out)[len(prompt) - 1:-1]
    assert int(logits[0].argmax()) == out[0]
    shortfall = logits.max(axis=1) - logits[np.arange(8), out]
    assert shortfall.max() < 0.05 * logits.std(), shortfall


@pytest.mark.parametrize("fmt,dtype", [("hf", "f16"), ("gguf", "bf16")])
def test_ferrum_generates_from_16_bit_weights_as_transformers_reads_them(models, fmt, dtype):
    """16-bit float weights in the CPU's R16 layout (decode: its row kernel, once per sequence of
    a batch; prefill: the float GEMM over it) against transformers on the same weights, three
    prompts decoded together. Activations stay f32 but in the BF16 prefill GEMM (rounded to
    bf16 there), so an F16 step must pick transformers' best token up to f32 rounding and a BF16
    step up to that rounding (a misread block or row lands far from the top)."""
    import ferrum
    path = models("qwen3", fmt, dtype, tokenizer=TOKENIZER_OF["mistral"], hidden_size=256,
                  intermediate_size=512, num_layers=4)
    llm = ferrum.LLM(str(path), num_threads=2)
    prompts = [llm.tokenizer.encode(t) for t in
               ("Once upon a time there was", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12")]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=ferrum.SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))
    ref = _load_hf(path) if fmt == "hf" else _load_gguf(path, head_dim=64)
    for prompt, o in zip(prompts, outs):
        out = o.outputs[0].token_ids
        logits = _logits(ref, prompt + out)[len(prompt) - 1:-1]
        shortfall = logits.max(axis=1) - logits[np.arange(8), out]
        assert shortfall.max() < (1e-4 if dtype == "f16" else 0.05) * logits.std(), shortfall
