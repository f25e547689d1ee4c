"""Rung 8: bad input raises a clear Python exception and the process survives."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

import ferrum
from conftest import STORIES, STORIES_FORMATS
from ferrum import _core


@pytest.fixture(scope="module")
def llm():
    return ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=128, kv_cache_tokens=256)


def test_out_of_range_token_ids(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(prompt_token_ids=[[1, 5, 512]])
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(prompt_token_ids=[[1, -3]])
    with pytest.raises(ValueError, match="out of range"):
        llm.runner.step([(llm.runner.add_sequence(), [100000], "last")])


def test_empty_and_too_long_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[1] * 128])
    with pytest.raises(ValueError):
        llm.score([1] * 129)
    with pytest.raises(ValueError):
        llm.generate()


def test_kv_pool_too_small_for_a_prompt():
    small = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=1, max_model_len=512, kv_cache_tokens=32)
    with pytest.raises(ValueError, match="never fit"):
        small.generate(prompt_token_ids=[[1] * 100])
    # a generation that outgrows the pool on its own ends with "length", no crash
    out = small.generate(prompt_token_ids=[[1, 5, 6]],
                         sampling_params=ferrum.SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) < 100
    assert small.stats()["kv_blocks_used"] == 0


def test_incremental_api_rejects_what_can_never_run(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([1] * 200)
    with pytest.raises(ValueError, match="out of range"):
        llm.add_request([1, 99999])
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(TypeError):
        llm.add_request([1, 2], sampling_params="greedy")
    assert not llm.has_unfinished()
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1, 2], request_id="x")
        llm.add_request([1, 2], request_id="x")
    llm.abort("x")
    assert llm.step()[0].output.outputs[0].finish_reason == "abort"
    assert llm.stats()["kv_blocks_used"] == 0


def test_engine_commit_rejects_bad_tokens(llm):
    eng = llm.engine.core
    seq = eng.add_sequence([1, 2, 3])
    out = eng.step()
    assert list(out["seqs"]) == [seq]
    with pytest.raises(ValueError, match="out of range"):
        eng.commit([seq], [10**6], [False])
    with pytest.raises(ValueError, match="one token"):
        eng.commit([seq], [1, 2], [False])
    eng.commit([seq], [5], [False])
    with pytest.raises(ValueError, match="not waiting"):
        eng.commit([seq], [5], [False])  # a second token without a step in between
    eng.abort(seq)
    assert llm.stats()["kv_blocks_used"] == 0


def test_runner_exhaustion_is_memory_error():
    r = _core.ModelRunner(STORIES_FORMATS["gguf"], num_threads=1, max_model_len=512, kv_cache_tokens=32)
    a, b = r.add_sequence(), r.add_sequence()
    r.step([(a, [1] * 20, "none")])
    with pytest.raises(MemoryError, match="KV cache exhausted"):
        r.step([(b, [1] * 20, "last")])
    assert r.sequence_length(b) == 0  # nothing was half-done
    r.release_sequence(a)
    r.release_sequence(b)
    assert r.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(max_tokens=0),
                                dict(n=0), dict(min_p=2.0), dict(repetition_penalty=0), dict(stop=5)])
def test_nonsense_sampling_params(kw):
    with pytest.raises(ValueError):
        ferrum.SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(kv_dtype="f8"), dict(num_threads=0), dict(max_model_len=-1),
                                dict(max_model_len=10**7), dict(device="tpu"), dict(max_num_seqs=0),
                                dict(max_num_batched_tokens=-4), dict(max_num_seqs=2.5),
                                dict(kv_cache_memory_fraction=0), dict(kv_cache_memory_fraction=1.5),
                                dict(kv_cache_tokens=64, kv_cache_memory=10**6), dict(enable_prefix_caching="no")])
def test_nonsense_llm_options(kw):
    with pytest.raises(ValueError):
        ferrum.LLM(STORIES_FORMATS["gguf"], **kw)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError):
        ferrum.LLM("./no/such/model.gguf")


# ---- corrupted files: each error names the file and the problem ----

def corrupt_copy(tmp_path, name, mutate):
    src = STORIES_FORMATS["gguf"]
    dst = tmp_path / name
    data = bytearray(open(src, "rb").read())
    data = mutate(data)
    dst.write_bytes(bytes(data))
    return str(dst)


def test_truncated_gguf(tmp_path):
    p = corrupt_copy(tmp_path, "trunc.gguf", lambda d: d[: len(d) // 2])
    with pytest.raises(ValueError, match="trunc.gguf.*past the end"):
        _core.ModelRunner(p)


def test_gguf_header_only(tmp_path):
    p = corrupt_copy(tmp_path, "head.gguf", lambda d: d[:200])
    with pytest.raises(ValueError, match="head.gguf.*(truncated|more than the file can hold)"):
        _core.ModelRunner(p)


def test_gguf_counts_past_eof(tmp_path):
    def mutate(d):
        d[8:16] = struct.pack("<Q", 10**12)  # tensor count
        return d
    p = corrupt_copy(tmp_path, "counts.gguf", mutate)
    with pytest.raises(ValueError, match="counts.gguf.*more than the file can hold"):
        _core.ModelRunner(p)


def test_gguf_bad_version(tmp_path):
    def mutate(d):
        d[4:8] = struct.pack("<I", 99)
        return d
    with pytest.raises(ValueError, match="version 99"):
        _core.ModelRunner(corrupt_copy(tmp_path, "v99.gguf", mutate))


def test_gguf_tensor_type_ferrum_does_not_read(tmp_path):
    """A ggml type ferrum does not read (here IQ2_XXS) is named in the error, not just numbered."""
    import gguf
    p = tmp_path / "iq2_xxs.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tensor("token_embd.weight", np.zeros((16, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="token_embd.weight' has ggml type IQ2_XXS \\(16\\), which ferrum does not read"):
        _core.ModelRunner(str(p))


def hf_copy(tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(os.path.join(STORIES, "hf-converted"), d)
    return d


def test_safetensors_header_lies_about_offsets(tmp_path):
    d = hf_copy(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n].decode()
    import json
    j = json.loads(header)
    name = next(k for k in j if k != "__metadata__")
    j[name]["data_offsets"][1] += 10**9
    new = json.dumps(j).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])
    with pytest.raises(ValueError, match="model.safetensors.*" + name.replace(".", r"\.") + ".*outside"):
        _core.ModelRunner(str(d))


def test_safetensors_truncated(tmp_path):
    d = hf_copy(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        _core.ModelRunner(str(d))


def test_shape_disagrees_with_config(tmp_path):
    import json
    d = hf_copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 200
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has shape .* but the config needs"):
        _core.ModelRunner(str(d))


def test_unknown_architecture(tmp_path):
    import json
    d = hf_copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json.*unknown architecture 'GPTNeoXForCausalLM'"):
        _core.ModelRunner(str(d))


def test_truncated_llama2c(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(open(STORIES_FORMATS["llama2c"], "rb").read()[:-4096])
    with pytest.raises(ValueError, match="model.bin.*truncated"):
        _core.ModelRunner(str(p))


def test_garbage_file(tmp_path):
    p = tmp_path / "junk.bin"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="junk.bin"):
        _core.ModelRunner(str(p))


def test_gguf_without_vocabulary_needs_a_tokenizer(tmp_path):
    from ferrum.tools.make_model import make_model
    path = make_model("llama", "tiny", "gguf", "f32", seed=1, vocab_size=256, out=tmp_path / "weights-only.gguf")
    with pytest.raises(ValueError, match="no vocabulary"):
        ferrum.LLM(str(path), num_threads=1)
    assert _core.ModelRunner(str(path)).format == "gguf"  # the weights themselves load


# ---- typed options and metadata: refused, never coerced ----

@pytest.mark.parametrize("kw", [dict(ignore_eos="no"), dict(ignore_eos=1), dict(ignore_eos=None),
                                dict(skip_special_tokens="yes"), dict(skip_special_tokens=0),
                                dict(max_tokens=2.0), dict(n=True), dict(seed="1"), dict(top_k=1.5)])
def test_sampling_params_types_are_not_coerced(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        ferrum.SamplingParams(**kw)


def _stories_tokenizer_metadata():
    return _core.ModelFile(STORIES_FORMATS["gguf"]).pop_tokenizer_metadata()


def _gpt2_metadata():
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("tokenizer.ggml.model"), "unsupported tokenizer.ggml.model None"),
    (lambda m: m.update({"tokenizer.ggml.model": 3}), "'tokenizer.ggml.model' is not a string"),
    (lambda m: m.update({"tokenizer.ggml.tokens": "abc"}), "'tokenizer.ggml.tokens' is not a list"),
    (lambda m: m.update({"tokenizer.ggml.tokens": [1, 2]}), r"'tokenizer.ggml.tokens'\[0\] is 1, not a string"),
    (lambda m: m.update({"tokenizer.ggml.tokens": []}), "'tokenizer.ggml.tokens' is empty"),
    (lambda m: m["tokenizer.ggml.scores"].pop(), "'tokenizer.ggml.scores' has 511 entries for 512 tokens"),
    (lambda m: m["tokenizer.ggml.token_type"].append(1), "'tokenizer.ggml.token_type' has 513 entries"),
    (lambda m: m.update({"tokenizer.ggml.scores": [float("nan")] * 512}), r"'tokenizer.ggml.scores'\[0\] is nan, not a finite number"),
    (lambda m: m["tokenizer.ggml.scores"].__setitem__(7, float("-inf")), r"'tokenizer.ggml.scores'\[7\] is -inf, not a finite number"),
    (lambda m: m["tokenizer.ggml.token_type"].__setitem__(300, 7), r"'tokenizer.ggml.token_type'\[300\] is 7, not a token type"),
    (lambda m: m["tokenizer.ggml.token_type"].__setitem__(300, 0), r"'tokenizer.ggml.token_type'\[300\] is 0"),
    (lambda m: m["tokenizer.ggml.tokens"].__setitem__(300, m["tokenizer.ggml.tokens"][299]),
     r"'tokenizer.ggml.tokens'\[300\] is .*, already token 299"),
    (lambda m: m["tokenizer.ggml.tokens"].__setitem__(3, "<0xZZ>"), r"'tokenizer.ggml.tokens'\[3\] is '<0xZZ>', but 'tokenizer.ggml.token_type'\[3\] says a byte token"),
    (lambda m: m.update({"tokenizer.ggml.bos_token_id": 512}), "'tokenizer.ggml.bos_token_id' is 512, outside the vocabulary of 512"),
    (lambda m: m.update({"tokenizer.ggml.eos_token_id": -2}), "'tokenizer.ggml.eos_token_id' is -2, outside"),
    (lambda m: m.update({"tokenizer.ggml.unknown_token_id": 2**31}), "'tokenizer.ggml.unknown_token_id' is 2147483648, outside"),
    (lambda m: m.update({"tokenizer.ggml.padding_token_id": 600}), "'tokenizer.ggml.padding_token_id' is 600, outside"),
    (lambda m: m.update({"tokenizer.ggml.eot_token_id": 10**12}), "'tokenizer.ggml.eot_token_id' is 1000000000000, outside"),
    (lambda m: m.update({"tokenizer.ggml.bos_token_id": 2**32 - 1, "tokenizer.ggml.add_bos_token": True}),
     "'tokenizer.ggml.add_bos_token' is true, but the vocabulary has no BOS token"),
    (lambda m: m.update({"tokenizer.ggml.eos_token_id": -1, "tokenizer.ggml.add_eos_token": True}),
     "'tokenizer.ggml.add_eos_token' is true, but the vocabulary has no EOS token"),
    (lambda m: m.update({"tokenizer.ggml.token_type": ["1"] * 512}), r"'tokenizer.ggml.token_type'\[0\] is '1', not an integer"),
    (lambda m: m.update({"tokenizer.ggml.bos_token_id": "1"}), "'tokenizer.ggml.bos_token_id' is not an integer"),
    (lambda m: m.update({"tokenizer.ggml.eos_token_id": 2.0}), "'tokenizer.ggml.eos_token_id' is not an integer"),
    (lambda m: m.update({"tokenizer.ggml.add_bos_token": 1}), "'tokenizer.ggml.add_bos_token' is not a boolean"),
    (lambda m: m.update({"tokenizer.chat_template": ["x"]}), "'tokenizer.chat_template' is not a string"),
])
def test_mistyped_tokenizer_metadata(edit, match):
    from ferrum.tokenizer import Tokenizer
    meta = _stories_tokenizer_metadata()
    edit(meta)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(meta)


def test_special_token_ids_as_llama_cpp_writes_them():
    """A key that is absent takes the format's default; llama.cpp's "no such token" (-1, written
    as int32 or uint32 0xFFFFFFFF, as stories260K's padding id is) is None."""
    from ferrum.tokenizer import Tokenizer
    meta = _stories_tokenizer_metadata()
    assert meta["tokenizer.ggml.padding_token_id"] == 2**32 - 1
    assert Tokenizer.from_gguf_metadata(meta).bos_token_id == 1
    for none in (-1, 2**32 - 1):
        tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.bos_token_id": none})
        assert tok.bos_token_id is None and not tok.add_bos and tok.encode("hi")[0] != 1
    meta.pop("tokenizer.ggml.bos_token_id")
    assert Tokenizer.from_gguf_metadata(meta).bos_token_id == 1  # SentencePiece's default
    # Added tokens of a byte-level vocabulary are plain text: only the model's tokens are bytes.
    tok = Tokenizer.from_gguf_metadata({**_gpt2_metadata(), "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end of text|>"],
                                        "tokenizer.ggml.token_type": [1, 1, 1, 3]})
    assert tok.encode("ab<|end of text|>") == [2, 3]


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("tokenizer.ggml.merges"), "needs tokenizer.ggml.merges"),
    (lambda m: m.update({"tokenizer.ggml.merges": ["ab"]}), "not two tokens joined by a space"),
    (lambda m: m.update({"tokenizer.ggml.merges": ["a c"]}), "'a c': it or its parts are not in the vocabulary"),
    (lambda m: m.update({"tokenizer.ggml.tokens": ["a", "b"]}), "'a b': it or its parts are not in the vocabulary"),
    (lambda m: m.update({"tokenizer.ggml.pre": "nonsense"}), "unsupported tokenizer.ggml.pre"),
    (lambda m: m.update({"tokenizer.ggml.tokens": ["a", "b", "a b"], "tokenizer.ggml.merges": []}),
     r"'tokenizer.ggml.tokens'\[2\] is 'a b', not in GPT-2's byte alphabet"),
])
def test_mistyped_byte_level_metadata(edit, match):
    from ferrum.tokenizer import Tokenizer
    meta = _gpt2_metadata()
    edit(meta)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(meta)


# ---- resources: bounded by what is used, exhaustion is MemoryError ----

# The child's own peak RSS in MiB (VmHWM: ru_maxrss would carry over the parent's across exec).
PEAK_MIB = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) >> 10"


def _child(code: str, limit_as: int = 0) -> str:
    """Runs code in a fresh interpreter (optionally under an address-space limit); its stdout."""
    import subprocess
    import sys
    pre = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit_as}, {limit_as}))\n" if limit_as else ""
    r = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_thread_start_failure_is_memory_error():
    """1000 workers' stacks do not fit under a 3 GB address-space limit: MemoryError, no abort."""
    out = _child("import ferrum._core as c\n"
                 "try:\n    c.make_backend('cpu', 1000)\nexcept MemoryError as e:\n    print('MemoryError', e)\n"
                 "print(c.make_backend('cpu', 2) is not None)", limit_as=3 << 30)
    assert "MemoryError could not start 999 worker threads" in out and out.strip().endswith("True")


def test_kv_pool_larger_than_memory_is_refused_before_allocating():
    out = _child(f"import ferrum._core as c\n"
                 f"try:\n    c.ModelRunner({STORIES_FORMATS['gguf']!r}, num_threads=1, kv_cache_bytes=1 << 40)\n"
                 f"except MemoryError as e:\n    print('MemoryError', e)\n"
                 f"print({PEAK_MIB})")
    lines = out.strip().splitlines()
    assert "MemoryError cannot allocate a KV cache of" in lines[0] and "the cpu device has" in lines[0]
    assert int(lines[-1]) < 400, f"peak RSS {lines[-1]} MiB before refusing"


@pytest.mark.parametrize("kv_bytes", [30 << 30, 1 << 40])
def test_kv_pool_larger_than_the_opencl_device_is_refused(kv_bytes):
    with pytest.raises(MemoryError, match="cannot allocate a KV cache of .* the opencl device has"):
        _core.ModelRunner(STORIES_FORMATS["gguf"], device="opencl", kv_cache_bytes=kv_bytes)


def test_declared_context_does_not_size_memory(tmp_path):
    """A 2^26-token context on a 1 MB model loads in bounded memory: tables follow the KV pool."""
    import gguf_edit as ge
    p = tmp_path / "long.gguf"
    p.write_bytes(ge.overwrite(open(STORIES_FORMATS["gguf"], "rb").read(), "kv:llama.context_length", 1 << 26))
    out = _child(f"import ferrum\n"
                 f"llm = ferrum.LLM({str(p)!r}, num_threads=1, kv_cache_tokens=4096)\n"
                 f"assert llm.runner.max_model_len == 1 << 26\n"
                 f"print({PEAK_MIB})")
    assert int(out.strip()) < 400, f"peak RSS {out.strip()} MiB"


def test_repeated_load_and_drop_does_not_grow(smollm2_path):
    import gc
    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    for _ in range(2):  # allocator pools and caches settle
        ferrum.LLM(smollm2_path, num_threads=1, kv_cache_tokens=256)
        gc.collect()
    before = rss_mib()
    for _ in range(4):
        ferrum.LLM(smollm2_path, num_threads=1, kv_cache_tokens=256)
        gc.collect()
    assert rss_mib() - before < 8, f"grew {rss_mib() - before:.1f} MiB over 4 loads"


def test_corrupt_tokenizer_files(tmp_path):
    from ferrum.tokenizer import Tokenizer
    spec = json.loads(open(os.path.join(STORIES, "hf-converted", "tokenizer.json")).read())
    spec["model"]["merges"] = ["s ;"] + spec["model"]["merges"]  # a merge of tokens not in the vocabulary
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="tokenizer.json cannot be built"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    model = open(os.path.join(os.path.dirname(STORIES), "tokenizers", "llama2", "tokenizer.model"), "rb").read()
    (tmp_path / "tokenizer.model").write_bytes(model[:1000])
    with pytest.raises(ValueError, match="tokenizer.model: not a SentencePiece model"):
        Tokenizer.from_file(tmp_path / "tokenizer.model")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.model")


def test_tokenizer_with_ids_the_model_cannot_embed():
    """A tokenizer= of 49152 tokens for a model whose embedding has 512 rows."""
    big = os.path.join(os.path.dirname(STORIES), "tokenizers", "smollm2-135m-instruct", "tokenizer.json")
    with pytest.raises(ValueError, match="the tokenizer has 49152 tokens, but stories260K.gguf's embedding has 512 rows"):
        ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=1, tokenizer=big)


@pytest.mark.parametrize("ids, error", [
    ([[1, 403, 1.5]], TypeError),      # a float is not a token id, not even 1.5 -> 1
    ([[1, "5"]], TypeError),
    ([[1, True]], TypeError),
    ([[1, 2**31]], ValueError),        # beyond int32
    ([[1, 2**63 + 5]], ValueError),    # beyond int64
    ([[1, -(2**40)]], ValueError),
])
def test_token_ids_are_integers_of_the_vocabulary(llm, ids, error):
    for call in (lambda: llm.generate(prompt_token_ids=ids), lambda: llm.add_request(ids[0]),
                 lambda: llm.score(ids[0])):
        with pytest.raises(error):
            call()
    with pytest.raises(TypeError):  # nested one level too deep
        llm.generate(prompt_token_ids=[ids])
    assert not llm.has_unfinished() and llm.stats()["kv_blocks_used"] == 0


def test_integers_beyond_64_bits_in_sampling_params(llm):
    """Huge but valid values mean 'no limit'; a logit_bias id beyond the vocabulary is a ValueError."""
    huge = 2**90
    for kw in [dict(top_k=huge, temperature=1.0, seed=huge), dict(max_tokens=huge), dict(stop_token_ids=[huge]),
               dict(logprobs=huge), dict(prompt_logprobs=huge)]:
        out = llm.generate(["Once"], ferrum.SamplingParams(**{"max_tokens": 3, **kw}))[0]
        assert out.outputs[0].token_ids, kw
    for bias in [{huge: 1.0}, {512: 1.0}]:
        with pytest.raises(ValueError, match="logit_bias token id"):
            llm.generate(["Once"], ferrum.SamplingParams(logit_bias=bias))
    assert not llm.has_unfinished() and llm.stats()["kv_blocks_used"] == 0


# ---- tokenizer files beside safetensors: refused by a named rule, never read otherwise ----

TOKENIZERS = os.path.join(os.path.dirname(STORIES), "tokenizers")


def _damaged_sentencepiece(tmp_path, edit) -> str:
    """llama2's tokenizer.model with the piece "m" (a protobuf string field: tag, length 1,
    the byte, then its score's tag) edited at the byte level."""
    data = open(os.path.join(TOKENIZERS, "llama2", "tokenizer.model"), "rb").read()
    at = data.find(b"\x0a\x01m\x15")
    path = tmp_path / "tokenizer.model"
    path.write_bytes(edit(bytearray(data), at))
    return str(path)


def test_sentencepiece_piece_not_utf8_is_refused(tmp_path):
    from ferrum.tokenizer import Tokenizer

    def flip(b, at):
        b[at + 2] = 0xFF
        return bytes(b)
    with pytest.raises(ValueError, match=r"tokenizer.model: piece 29885 is not valid UTF-8"):
        Tokenizer.from_file(_damaged_sentencepiece(tmp_path, flip))


def test_sentencepiece_score_not_finite_is_refused(tmp_path):
    from ferrum.tokenizer import Tokenizer

    def inf(b, at):
        b[at + 4:at + 8] = struct.pack("<f", float("inf"))
        return bytes(b)
    with pytest.raises(ValueError, match=r"tokenizer.model: piece 29885 has the score inf, not a finite number"):
        Tokenizer.from_file(_damaged_sentencepiece(tmp_path, inf))


def _smollm2_dir(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(os.path.join(TOKENIZERS, "smollm2-135m-instruct"), d)
    return d


@pytest.mark.parametrize("damage,match", [
    (lambda t: t.replace(b'"Hello":', b'"Hel\xfflo":', 1), r"tokenizer.json: not valid UTF-8 \(byte \d+\)"),
    (lambda t: t.replace(b'"Hello":', b'"hello":', 1), "tokenizer.json: the key 'hello' appears twice in one object"),
    (lambda t: t.replace(b'"Hello": 19556', b'"Hello": 19557', 1), "tokenizer.json: the vocabulary gives id 19557 to two tokens"),
])
def test_damaged_tokenizer_json_is_refused(tmp_path, damage, match):
    from ferrum.tokenizer import Tokenizer
    d = _smollm2_dir(tmp_path)
    text = (d / "tokenizer.json").read_bytes()
    assert b'"Hello": 19556' in text and b'"hello":' in text
    (d / "tokenizer.json").write_bytes(damage(text))
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("name,content,match", [
    ("tokenizer_config.json", {"bos_token": "<|nonexistent|>"}, "bos_token '<|nonexistent|>' is not in the vocabulary"),
    ("tokenizer_config.json", {"eos_token": {"content": "<|nope|>"}}, "eos_token '<|nope|>' is not in the vocabulary"),
    ("tokenizer_config.json", {"add_bos_token": True}, "add_bos_token is true, but there is no bos_token"),
    ("generation_config.json", {"eos_token_id": 49152}, "generation_config.json: eos_token_id is 49152, not a token id of the 49152-token"),
    ("generation_config.json", {"eos_token_id": [2, -1]}, "eos_token_id is -1, not a token id"),
    ("config.json", {"eos_token_id": 10**9}, "config.json: eos_token_id is 1000000000, not a token id"),
])
def test_special_tokens_outside_the_vocabulary_are_refused(tmp_path, name, content, match):
    from ferrum.tokenizer import Tokenizer
    d = _smollm2_dir(tmp_path)
    (d / name).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(d)
