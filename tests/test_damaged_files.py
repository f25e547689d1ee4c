"""A damaged model file either loads with exactly its source's outputs or is refused with a
ValueError naming the file and the first rule it breaks (never NaN, never garbage).

The first tests are the cases a corruption campaign found accepted; the property tests at the
end damage one field at a time (every header field of a GGUF, a safetensors entry or config.json
value, a llama2.c header int) in files of each format made by the project's generator and the
stories260K models.
"""
import json
import math
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gguf_edit as ge
from conftest import STORIES, STORIES_FORMATS
from ferrum import _core
from ferrum.tools.make_model import make_model

PROMPT = [1, 5, 9, 20, 33, 7]
F32, F16, Q8_0, BF16, Q4_0, IQ4_NL, U32, F32_VALUE, STRING = 0, 1, 8, 30, 2, 20, 4, 6, 8


def outputs(path):
    """Logits at every prompt position, or the ValueError that refused the file."""
    try:
        r = _core.ModelRunner(str(path), num_threads=1, max_model_len=64, kv_cache_tokens=64)
    except ValueError as e:
        return e
    return r.step([(r.add_sequence(), PROMPT, "all")])


def refused(path, match):
    with pytest.raises(ValueError, match=match):
        _core.ModelRunner(str(path), num_threads=1, max_model_len=64, kv_cache_tokens=64)


def stories_gguf() -> bytes:
    return open(STORIES_FORMATS["gguf"], "rb").read()


def write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A generated llama with rope.freq_base and general.alignment (weights only)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return make_model("llama", "tiny", "gguf", "f32", seed=3, out=out, vocab_size=64).read_bytes()


def hf_copy(tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(STORIES_FORMATS["safetensors"], d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def safetensors_parts(f):
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return n, data[8:8 + n], data[8 + n:]


def write_safetensors(f, header: bytes, body: bytes):
    header += b" " * (-len(header) % 8)
    f.write_bytes(struct.pack("<Q", len(header)) + header + body)


# ---- the campaign's accepted cases, each refused by a named rule ----

def test_tensor_offset_not_aligned(tmp_path):
    d = stories_gguf()
    name = ge.Gguf.parse(d).tensors[3].name
    p = write(tmp_path, "misaligned.gguf", ge.overwrite(d, f"tensor:{name}:offset", ge.read(d, f"tensor:{name}:offset") + 4))
    refused(p, f"misaligned.gguf: tensor '{name}' has data offset .* not a multiple of the alignment 32")


def test_tensor_offset_that_wraps_around_to_the_header(tmp_path):
    d = stories_gguf()
    data_start = len(d) - len(ge.Gguf.parse(d).data)
    name = ge.Gguf.parse(d).tensors[0].name
    p = write(tmp_path, "wrap.gguf", ge.overwrite(d, f"tensor:{name}:offset", 2**64 - data_start))
    refused(p, "wrap.gguf: .* bytes of the data section before tensor '" + name + "' belong to no tensor")


@pytest.mark.parametrize("new_type", [F16, Q8_0])
def test_tensor_type_that_needs_fewer_bytes_than_its_data(tmp_path, new_type):
    d = stories_gguf()
    g = ge.Gguf.parse(d)
    i = next(i for i, t in enumerate(g.tensors) if t.name == "blk.0.attn_q.weight")
    p = write(tmp_path, "shrunk.gguf", ge.overwrite(d, "tensor:blk.0.attn_q.weight:type", new_type))
    refused(p, "shrunk.gguf: .* bytes of the data section before tensor '" + g.tensors[i + 1].name +
            "' belong to no tensor \\(the type or shape of 'blk.0.attn_q.weight' does not match its data\\)")


def test_same_bytes_under_another_type_and_shape(tmp_path):
    g = ge.Gguf.parse(stories_gguf())
    t = next(t for t in g.tensors if t.name == "output_norm.weight")
    t.dims, t.type = [t.dims[0] * 2], F16  # 64 floats read as 128 halves: the shape says no
    refused(write(tmp_path, "samebytes.gguf", g.serialize()),
            "samebytes.gguf: tensor 'output_norm.weight' has shape \\[128\\] but the config needs \\[64\\]")
    g = ge.Gguf.parse(stories_gguf())
    last = g.tensors[-1]
    last.type = F16  # the last tensor: the half it lost lies after it
    refused(write(tmp_path, "lasthalf.gguf", g.serialize()),
            f"lasthalf.gguf: .* bytes after the data of tensor '{last.name}' belong to no tensor")


def test_tensor_type_change_within_the_padding_is_refused(tmp_path, tiny_gguf):
    g = ge.Gguf.parse(tiny_gguf)
    # A 1-D F32 tensor of 8 floats (32 bytes) declared F16 (16 bytes): the next offset stays the
    # same after padding to 32, but the padding now holds the tensor's second half.
    g.tensors.append(ge.TensorInfo("pad_probe", [8], F16, len(g.data)))
    g.data = g.data + np.arange(1, 9, dtype=np.float32).tobytes()
    refused(write(tmp_path, "padding.gguf", g.serialize()), "padding.gguf: tensor 'pad_probe' is followed by nonzero padding")


def test_overlapping_tensors(tmp_path):
    d = stories_gguf()
    g = ge.Gguf.parse(d)
    a, b = g.tensors[5], g.tensors[6]
    p = write(tmp_path, "overlap.gguf", ge.overwrite(d, f"tensor:{b.name}:offset", a.offset))
    refused(p, f"overlap.gguf: tensor '{b.name}' data at offset {a.offset} overlaps tensor '{a.name}'")


@pytest.mark.parametrize("eps", [-1e-5, math.nan, 0.0, math.inf])
def test_rms_norm_eps_out_of_range(tmp_path, eps):
    p = write(tmp_path, "eps.gguf", ge.overwrite(stories_gguf(), "kv:llama.attention.layer_norm_rms_epsilon", eps))
    refused(p, "eps.gguf: rms_norm_eps .* is not in \\(0, 1\\]")
    d = edit_config(hf_copy(tmp_path), rms_norm_eps=eps if math.isfinite(eps) else -1.0)
    refused(d, "config.json: rms_norm_eps .* is not in \\(0, 1\\]")


@pytest.mark.parametrize("theta", [0.0, -10000.0, math.nan])
def test_rope_theta_out_of_range(tmp_path, tiny_gguf, theta):
    p = write(tmp_path, "theta.gguf", ge.overwrite(tiny_gguf, "kv:llama.rope.freq_base", theta))
    refused(p, "theta.gguf: rope_theta .* is not a positive number")
    if math.isfinite(theta):  # JSON has no NaN
        refused(edit_config(hf_copy(tmp_path), rope_theta=theta), "config.json: rope_theta .* is not a positive number")


def test_block_count_smaller_than_the_layers_present(tmp_path):
    p = write(tmp_path, "layers.gguf", ge.overwrite(stories_gguf(), "kv:llama.block_count", 4))
    refused(p, "layers.gguf: tensor 'blk.4.* is not part of a 4-layer llama model")
    refused(edit_config(hf_copy(tmp_path), num_hidden_layers=4),
            "hf: tensor 'model.layers.4.* is not part of a 4-layer llama model")


def test_safetensors_header_length_one_byte_short(tmp_path):
    d = hf_copy(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    assert data[8 + n - 1:8 + n] == b" "  # the header's padding: it still parses one byte short
    f.write_bytes(struct.pack("<Q", n - 1) + data[8:])
    refused(d, "model.safetensors: the last 1 bytes of the data section belong to no tensor")


@pytest.mark.parametrize("vtype,value,kind", [(STRING, "2048", "a string"), (F32_VALUE, 2048.0, "a float")])
def test_gguf_metadata_of_the_wrong_type(tmp_path, vtype, value, kind):
    g = ge.Gguf.parse(stories_gguf()).set("llama.context_length", vtype, value)
    refused(write(tmp_path, "ctx.gguf", g.serialize()), f"ctx.gguf: metadata 'llama.context_length' is {kind}, expected an integer")


@pytest.mark.parametrize("value", ["512", 512.0, True])
def test_config_json_of_the_wrong_type(tmp_path, value):
    refused(edit_config(hf_copy(tmp_path), max_position_embeddings=value),
            "config.json: 'max_position_embeddings' is .* expected an integer")


@pytest.mark.parametrize("delta", [1, -1])
def test_vocabulary_and_embedding_disagree(tmp_path, delta):
    g = ge.Gguf.parse(stories_gguf())
    item, tokens = g.get("tokenizer.ggml.tokens")
    g.set("tokenizer.ggml.tokens", 9, (item, tokens + [b"extra"] if delta > 0 else tokens[:-1]))
    refused(write(tmp_path, "vocab.gguf", g.serialize()),
            f"vocab.gguf: the vocabulary has {512 + delta} tokens, but token_embd.weight has 512 rows")


def test_gguf_repeated_tensor_and_key(tmp_path):
    g = ge.Gguf.parse(stories_gguf())
    g.tensors.append(ge.TensorInfo(g.tensors[1].name, g.tensors[1].dims, g.tensors[1].type, len(g.data)))
    refused(write(tmp_path, "twice.gguf", g.serialize()), f"twice.gguf: tensor '{g.tensors[1].name}' appears twice")
    g = ge.Gguf.parse(stories_gguf())
    g.kvs.append(["llama.block_count", U32, 4])
    refused(write(tmp_path, "key.gguf", g.serialize()), "key.gguf: metadata key 'llama.block_count' appears twice")


def test_json_repeated_keys(tmp_path):
    d = hf_copy(tmp_path)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"num_hidden_layers": 5,', '"num_hidden_layers": 5, "num_hidden_layers": 4,'))
    refused(d, "config.json: key 'num_hidden_layers' appears twice")
    d = hf_copy(tmp_path / "b")
    f = d / "model.safetensors"
    n, header, body = safetensors_parts(f)
    j = json.loads(header)
    name = next(k for k in j if k != "__metadata__")
    entry = json.dumps({name: j[name]})[1:-1]
    write_safetensors(f, header.rstrip()[:-1] + b", " + entry.encode() + b"}", body)
    refused(d, f"model.safetensors: safetensors header: key '{name}' appears twice")


def test_safetensors_gap_between_tensors(tmp_path):
    d = hf_copy(tmp_path)
    f = d / "model.safetensors"
    n, header, body = safetensors_parts(f)
    j = json.loads(header)
    last = max((k for k in j if k != "__metadata__"), key=lambda k: j[k]["data_offsets"][0])
    write_safetensors(f, header, body + b"\0" * 4)  # 4 bytes no tensor holds
    refused(d, "model.safetensors: the last 4 bytes of the data section belong to no tensor")
    j[last]["dtype"] = "I32"  # same size as F32: refused by what the tensor is for
    write_safetensors(f, json.dumps(j).encode(), body)
    refused(d, f"tensor '{last}' has type i32, which cannot hold")


def test_llama2c_tokenizer_must_match_the_embedding(tmp_path):
    import ferrum
    p = tmp_path / "model.bin"
    shutil.copy(STORIES_FORMATS["llama2c"], p)
    tok = open(os.path.join(STORIES, "tok512.bin"), "rb").read()
    (tmp_path / "tokenizer.bin").write_bytes(tok + struct.pack("<fi", 0.0, 3) + b"xyz")  # a 513th token
    with pytest.raises(ValueError, match="the tokenizer has 513 tokens, but model.bin's embedding has 512 rows"):
        ferrum.LLM(str(p), num_threads=1)


def test_seeds_and_sources_load_unchanged(tiny_gguf, tmp_path):
    """The property tests' sources are valid: loading them gives their outputs."""
    for path in (STORIES_FORMATS["gguf"], STORIES_FORMATS["llama2c"], STORIES_FORMATS["safetensors"],
                 write(tmp_path, "tiny.gguf", tiny_gguf)):
        out = outputs(path)
        assert isinstance(out, np.ndarray) and np.isfinite(out).all(), path


# ---- the invariant over random single-field damage ----

# Type changes to a type of the same size (F16 <-> BF16, Q4_0 <-> IQ4_NL) make another valid file:
# GGUF has no checksum to tell them apart, so they are not damage this test can ask to refuse.
SAME_SIZE_TYPES = [{F16, BF16}, {Q4_0, IQ4_NL}]
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def check_invariant(path, reference):
    out = outputs(path)
    if isinstance(out, ValueError):
        return
    assert np.isfinite(out).all(), f"{path} loaded and gave non-finite logits"
    assert np.array_equal(out, reference), f"{path} loaded with outputs other than its source's"


def damaged_int(draw, old: int) -> int:
    return draw(st.sampled_from([0, 1, old + 1, old - 1, old * 2, old // 2, old + 32, 2**31, 2**32 - 1,
                                 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))


@st.composite
def resized(draw, data: bytes):
    """data cut short, or with a few bytes appended."""
    if draw(st.booleans()):
        return data[:draw(st.integers(0, len(data) - 1))]
    return data + draw(st.binary(min_size=1, max_size=64))


@st.composite
def gguf_damage(draw, data: bytes):
    """One header field overwritten (4 times in 5), or the file cut short or lengthened."""
    if draw(st.integers(0, 4)) == 0:
        return draw(resized(data))
    f = draw(st.sampled_from(ge.fields(data)))
    (old,) = struct.unpack_from(f.fmt, data, f.offset)
    if f.fmt in ("<f", "<d"):
        new = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -old]))
    else:
        new = damaged_int(draw, old)
        if f.what.endswith(":type") and f.what.startswith("tensor:"):
            assume(not any({old, new % 2**32} <= pair for pair in SAME_SIZE_TYPES))
    return ge.overwrite(data, f.what, new)


@pytest.fixture(scope="module")
def gguf_sources(tiny_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf_sources")
    q8 = make_model("qwen3", "tiny", "gguf", "q8_0", seed=4, out=tmp / "q8.gguf", vocab_size=64).read_bytes()
    sources = [stories_gguf(), tiny_gguf, q8]
    return [(d, outputs(write(tmp, f"source{i}.gguf", d))) for i, d in enumerate(sources)]


@pytest.mark.parametrize("source", range(3))
def test_damaged_gguf_is_refused_or_unchanged(gguf_sources, source, tmp_path):
    data, reference = gguf_sources[source]

    @PROPERTY
    @given(damaged=gguf_damage(data))
    def check(damaged):
        check_invariant(write(tmp_path, "damaged.gguf", damaged), reference)
    check()


@st.composite
def config_damage(draw, config: dict):
    key = draw(st.sampled_from(sorted(k for k, v in config.items() if isinstance(v, (int, float)) and v is not None)))
    old = config[key]
    if isinstance(old, bool):
        new = draw(st.sampled_from([0, 1, "true", [old]]))
    elif isinstance(old, int):
        new = draw(st.sampled_from([0, -1, old + 1, old - 1, old * 2, old + 0.5, float(old), str(old), None, 2**40]))
        if key in ("bos_token_id", "eos_token_id"):  # the tokenizer's, not the weights'
            assume(False)
    else:
        new = draw(st.sampled_from([-old, 0.0, str(old), [old], math.inf]))
    return {**config, key: new}


@st.composite
def safetensors_damage(draw, header: dict):
    """One header entry's field changed (or removed), or the header length field moved."""
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = dict(header[name])
    what = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "length"]))
    if what == "length":
        return None, draw(st.sampled_from([-9, -8, -1, 1, 8]))
    if what == "dtype":
        entry["dtype"] = draw(st.sampled_from(["F32", "F16", "I32", "I8", "U8", "F64", "bogus", 3]))
        assume(entry["dtype"] != header[name]["dtype"])
    elif what == "shape":
        dims = list(entry["shape"])
        i = draw(st.integers(0, len(dims) - 1))
        dims[i] = draw(st.sampled_from([0, -1, dims[i] + 1, dims[i] * 2, dims[i] // 2, float(dims[i]), str(dims[i])]))
        entry["shape"] = dims
    elif what == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = draw(st.sampled_from([[b + 4, e + 4], [b - 4, e - 4], [b, e + 4], [e, b], [b + 1, e + 1],
                                                      [b, 2**64 - 1], [b], [float(b), e]]))
    elif what == "drop":
        del entry[draw(st.sampled_from(sorted(entry)))]
    out = dict(header)
    if what == "rename":
        out[name + "x"] = out.pop(name)
    else:
        out[name] = entry
    return out, 0


def test_damaged_safetensors_is_refused_or_unchanged(tmp_path):
    reference = outputs(STORIES_FORMATS["safetensors"])
    src = STORIES_FORMATS["safetensors"]
    n, header, body = safetensors_parts(__import__("pathlib").Path(src) / "model.safetensors")
    header_json = json.loads(header)
    config = json.loads(open(os.path.join(src, "config.json")).read())

    @PROPERTY
    @given(damage=safetensors_damage(header_json), new_config=config_damage(config), which=st.booleans())
    def check(damage, new_config, which):
        d = tmp_path / "hf"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        if which:
            (d / "config.json").write_text(json.dumps(new_config))
        else:
            new_header, shift = damage
            if new_header is None:
                raw = (d / "model.safetensors").read_bytes()
                (d / "model.safetensors").write_bytes(struct.pack("<Q", (n + shift) % 2**64) + raw[8:])
            else:
                write_safetensors(d / "model.safetensors", json.dumps(new_header).encode(), body)
        check_invariant(d, reference)
    check()


@st.composite
def llama2c_damage(draw, data: bytes):
    """One header int overwritten (3 times in 4), or the file cut short or lengthened."""
    if draw(st.integers(0, 3)) == 0:
        return draw(resized(data))
    i = draw(st.integers(0, 6))
    (old,) = struct.unpack_from("<i", data, 4 * i)
    new = draw(st.sampled_from([0, -1, old + 1, old - 1, old * 2, -old, 2**31 - 1, -2**31]))
    assume(new != old)
    out = bytearray(data)
    struct.pack_into("<i", out, 4 * i, new)
    return bytes(out)


def test_damaged_llama2c_is_refused_or_unchanged(tmp_path):
    data = open(STORIES_FORMATS["llama2c"], "rb").read()
    reference = outputs(STORIES_FORMATS["llama2c"])

    @PROPERTY
    @given(damaged=llama2c_damage(data))
    def check(damaged):
        check_invariant(write(tmp_path, "damaged.bin", damaged), reference)
    check()


# ---- tokenizer metadata: refused, or read exactly as written ----

CONTROL = 3


def byte_level_vocab_gguf(path) -> bytes:
    """A small GPT-2 style vocabulary (the 256 byte symbols, a few merges, two control tokens),
    written by gguf-py alone (no tensors)."""
    import gguf
    from ferrum.tokenizer_backends import byte_level_alphabet
    tokens = list(byte_level_alphabet()) + ["Ġt", "he", "Ġthe", "in", "<|endoftext|>", "<|im_start|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [CONTROL, CONTROL])
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return open(path, "rb").read()


def tokenizer_of(path):
    """The tokenizer ferrum reads from a GGUF (as LLM does), or the ValueError refusing it."""
    from ferrum.tokenizer import Tokenizer
    try:
        meta = {k: v for k, v in _core.gguf_metadata(str(path)).items() if k.startswith("tokenizer.")}
        return Tokenizer.from_gguf_metadata(meta)
    except ValueError as e:
        return e


def test_a_token_that_is_not_utf8_is_refused_by_index(tmp_path):
    """One flipped byte in the token "m" made the vocabulary tokenize "Once upon a time" in 8 ids."""
    g = ge.Gguf.parse(stories_gguf())
    item, tokens = g.get("tokenizer.ggml.tokens")
    i = tokens.index(b"m")
    tokens[i] = b"\xed"
    path = write(tmp_path, "bad_token.gguf", g.serialize())
    with pytest.raises(ValueError, match=rf"'tokenizer.ggml.tokens'\[{i}\] is not valid UTF-8 \(byte 0 of 1\)"):
        import ferrum
        ferrum.LLM(str(path))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(min_size=1, max_size=6))
def test_token_bytes_are_refused_exactly_when_they_are_not_utf8(tmp_path_factory, raw):
    """CPython's UTF-8 decoder is the reference: a GGUF string it cannot decode is refused, one it
    decodes is read as those characters."""
    g = ge.Gguf.parse(stories_gguf())
    _, tokens = g.get("tokenizer.ggml.tokens")
    tokens[300] = raw
    path = write(tmp_path_factory.mktemp("utf8"), "t.gguf", g.serialize())
    try:
        expected = raw.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(ValueError, match=r"'tokenizer.ggml.tokens'\[300\] is not valid UTF-8"):
            _core.gguf_metadata(str(path))
        return
    assert _core.gguf_metadata(str(path))["tokenizer.ggml.tokens"][300] == expected


@st.composite
def tokenizer_damage(draw, g: ge.Gguf):
    """One tokenizer field of a parsed GGUF damaged in place: a byte of a token flipped, a token
    type, a score or a special-token id overwritten."""
    keys = [k for k, _, _ in g.kvs if k.startswith("tokenizer.ggml.") and (
        k.endswith("_token_id") or k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"))]
    key = draw(st.sampled_from(sorted(keys)))
    value = g.get(key)
    if key.endswith("_token_id"):
        n = len(g.get("tokenizer.ggml.tokens")[1])
        g.set(key, U32, draw(st.sampled_from([0, 1, n - 1, n, n + 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)))
        return key
    item, items = value
    i = draw(st.integers(0, len(items) - 1))
    if key == "tokenizer.ggml.tokens":
        b = bytearray(items[i] or b"?")
        j = draw(st.integers(0, len(b) - 1))
        b[j] ^= draw(st.integers(1, 255))
        items[i] = bytes(b)
    elif key == "tokenizer.ggml.scores":
        items[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -items[i], 1e30]))
    else:
        items[i] = draw(st.integers(-2**31, 2**31 - 1) | st.integers(0, 8))
    return f"{key}[{i}]"


def read_as_written(path, tok):
    """gguf-py's own reading of the file (independent of ferrum's reader) agrees with what ferrum
    built from it: every token text, the control tokens, the special-token ids."""
    import gguf
    r = gguf.GGUFReader(str(path))

    def array(key):
        f = r.fields.get(key)
        return None if f is None else [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in array("tokenizer.ggml.tokens")]
    n = len(tokens)
    assert tok.vocab_size == n and all(tok.id_to_token(i) == t for i, t in enumerate(tokens))
    scores = array("tokenizer.ggml.scores")
    assert scores is None or all(math.isfinite(float(s[0])) for s in scores)
    types = [int(t[0]) for t in array("tokenizer.ggml.token_type")]
    assert all(1 <= t <= 6 for t in types) and len(set(tokens)) == n
    assert tok.special_token_ids == {i for i, t in enumerate(types) if t == CONTROL}
    for key, got in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id)):
        f = r.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            stored = int(f.parts[-1][0])
            assert got == (None if stored == 2**32 - 1 else stored) and (got is None or got < n)


@pytest.mark.parametrize("source", ["stories260K", "byte-level"])
def test_damaged_tokenizer_metadata_is_refused_or_read_as_written(source, tmp_path):
    """A GGUF has no checksum, so a damaged vocabulary that keeps every rule is another valid
    vocabulary; what ferrum must never do is read one other than the file says (replacement
    characters for bad bytes, a BOS quietly dropped for an id outside the vocabulary)."""
    data = stories_gguf() if source == "stories260K" else byte_level_vocab_gguf(tmp_path / "vocab.gguf")

    @settings(max_examples=60, deadline=None, derandomize=True,
              database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def check(draw):
        g = ge.Gguf.parse(data)
        where = draw.draw(tokenizer_damage(g))
        path = write(tmp_path, "damaged.gguf", g.serialize())
        tok = tokenizer_of(path)
        if isinstance(tok, ValueError):  # refused by a rule about what was damaged
            key = where.split("[")[0]
            assert key in str(tok) or (key == "tokenizer.ggml.tokens" and "tokenizer.ggml.merges" in str(tok)), (where, tok)
        else:
            read_as_written(path, tok)
            tok.decode(tok.encode("Once upon a time, 42 <s> héllo"))
    check()
