"""Rung 8: bad input raises a clear Python exception and the process survives."""
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
                                dict(kv_cache_tokens=64, kv_cache_memory=10**6)])
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
