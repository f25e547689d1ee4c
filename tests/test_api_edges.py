"""vLLM's API edges: prompt dicts, decoded tokens in logprobs, best_of, get_tokenizer, chat's
continue_final_message and tools, embeddings (against transformers' hidden states), close() and
the context manager; the model_type / architectures check and what counts as a path or a hub id."""
import json
import os
import shutil
import threading
import weakref

import numpy as np
import pytest

import ferrum
from conftest import STORIES_FORMATS
from ferrum import models

STORIES = STORIES_FORMATS["gguf"]
GREEDY = ferrum.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return ferrum.LLM(STORIES, num_threads=2)


def texts(outs):
    return [o.outputs[0].text for o in outs]


# ---- prompts as vLLM takes them ----------------------------------------------------------------

def test_prompt_dicts_generate_what_text_and_token_ids_do(llm):
    text = "Once upon a time"
    ids = llm.tokenizer.encode(text)
    plain = llm.generate([text], GREEDY)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert len(by_ids) == 1 and by_ids[0].outputs[0].token_ids == plain.outputs[0].token_ids
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids
    mixed = llm.generate([{"prompt": text}, text, {"prompt_token_ids": ids}, {"prompt": "x", "prompt_token_ids": ids}],
                         GREEDY)
    assert texts(mixed) == [plain.outputs[0].text] * 4
    assert [o.prompt for o in mixed] == [text, text, None, "x"]
    assert "".join(llm.stream({"prompt_token_ids": ids}, GREEDY)) == plain.outputs[0].text
    rid = llm.add_request({"prompt": text}, GREEDY)
    while llm.has_unfinished():
        for d in llm.step():
            if d.finished:
                assert d.request_id == rid and d.output.outputs[0].text == plain.outputs[0].text


@pytest.mark.parametrize("bad, error, words", [
    (123, TypeError, "prompt_token_ids"),
    ([1, 2, 3], TypeError, "got int"),
    ({"prompt": 5}, TypeError, "'prompt' must be a str"),
    ({}, TypeError, "prompt_token_ids"),
    ([{"prompt": "hi", "multi_modal_data": {}}], ValueError, "multi_modal_data"),
    ({"prompt_token_ids": ["a"]}, TypeError, "integers"),
])
def test_other_prompts_are_refused_saying_what_is_accepted(llm, bad, error, words):
    with pytest.raises(error, match=words):
        llm.generate(bad, GREEDY)


def test_embed_and_stream_refuse_other_prompt_types(llm):
    with pytest.raises(TypeError, match="a prompt is a str"):
        llm.embed(3.5)
    with pytest.raises(TypeError, match="a prompt is a str"):
        next(llm.stream(None))


# ---- logprobs name their tokens ----------------------------------------------------------------

def test_logprobs_carry_decoded_tokens(llm):
    params = ferrum.SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3, prompt_logprobs=2,
                                   ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0]
    steps = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert len(steps) == 6 + len(out.prompt_token_ids) - 1
    for step in steps:
        assert step and all(lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
                            for t, lp in step.items())


# ---- best_of -----------------------------------------------------------------------------------

def test_best_of_returns_the_n_most_likely_of_best_of(llm):
    sample = dict(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    every = llm.generate("Once upon a time", ferrum.SamplingParams(n=5, logprobs=0, **sample))[0].outputs
    best = llm.generate("Once upon a time", ferrum.SamplingParams(n=2, best_of=5, **sample))[0].outputs
    ranked = sorted(every, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [(o.index, o.text) for o in best] == [(o.index, o.text) for o in ranked]
    assert [o.cumulative_logprob for o in best] == pytest.approx([o.cumulative_logprob for o in ranked], abs=1e-9)
    assert all(o.logprobs is None for o in best)  # not asked for: only ranked by
    assert len({o.text for o in every}) > 2  # the ranking chose among different completions


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=3, best_of=2, temperature=1.0), "best_of must be None or an integer >= n"),
    (dict(n=1, best_of=3, temperature=0.0), "needs temperature > 0"),
    (dict(best_of=2.5, temperature=1.0), "best_of"),
])
def test_bad_best_of(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ferrum.SamplingParams(**kwargs)


@pytest.mark.parametrize("count", [2 ** 70, "blocks + 1"])
@pytest.mark.parametrize("name", ["n", "best_of"])
def test_more_completions_than_kv_blocks_are_refused_at_once(llm, name, count):
    count = llm.stats()["kv_blocks_total"] + 1 if count == "blocks + 1" else count
    with pytest.raises(ValueError, match="completions"):
        llm.generate("Once", ferrum.SamplingParams(temperature=1.0, max_tokens=2, **{name: count}))
    assert llm.stats()["sequences"] == 0
    assert len(llm.generate("Once", ferrum.SamplingParams(n=3, temperature=1.0, max_tokens=2))[0].outputs) == 3


def test_stream_refuses_best_of(llm):
    with pytest.raises(ValueError, match="best_of"):
        next(llm.stream("Once", ferrum.SamplingParams(best_of=3, temperature=1.0)))


# ---- tokenizer and chat ------------------------------------------------------------------------

def test_get_tokenizer(llm):
    assert llm.get_tokenizer() is llm.tokenizer


def test_chat_continues_the_final_message(smollm2):
    messages = [{"role": "user", "content": "Introduce yourself."},
                {"role": "assistant", "content": "Hello! My name is"}]
    params = ferrum.SamplingParams(max_tokens=8, temperature=0)
    out = smollm2.chat(messages, params, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nHello! My name is")
    full = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert full.startswith(out.prompt) and full[len(out.prompt):].startswith("<|im_end|>")
    assert out.outputs[0].text == smollm2.generate(out.prompt, params)[0].outputs[0].text
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        smollm2.chat(messages, params, continue_final_message=True)
    with pytest.raises(ValueError, match="last message"):
        smollm2.chat(messages[:1] + [{"role": "assistant", "content": ""}], params,
                     add_generation_prompt=False, continue_final_message=True)


def test_chat_passes_tools_to_the_template():
    llm = ferrum.LLM(STORIES, num_threads=1)
    llm.tokenizer.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                                   "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "Rain?"}], GREEDY, tools=tools)
    assert out.prompt == "[tool get_weather]user: Rain?\n"
    assert llm.chat([{"role": "user", "content": "Rain?"}], GREEDY).prompt == "user: Rain?\n"


# ---- embeddings --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stories_f32():
    return ferrum.LLM(STORIES_FORMATS["safetensors"], kv_dtype="f32", num_threads=2)


@pytest.fixture(scope="module")
def hf_hidden():
    """transformers' final hidden states (its last hidden_states entry: after the final norm)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(STORIES_FORMATS["safetensors"], dtype=torch.float32)

    def hidden(ids):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].double().numpy()
    return hidden


def test_embeddings_match_transformers_hidden_states(stories_f32, hf_hidden):
    prompts = ["Once upon a time, there was a little girl named Lily.", "The cat sat on the mat.",
               {"prompt_token_ids": [1, 400, 23, 9, 87]}]
    for pooling in ("last", "mean"):
        outs = stories_f32.embed(prompts, pooling=pooling)
        raw = stories_f32.embed(prompts, pooling=pooling, normalize=False)
        assert len(outs) == 3
        for out, unnormalised in zip(outs, raw):
            states = hf_hidden(out.prompt_token_ids)
            want = states[-1] if pooling == "last" else states.mean(axis=0)
            np.testing.assert_allclose(unnormalised.outputs.embedding, want, rtol=0, atol=1e-4)
            np.testing.assert_allclose(out.outputs.embedding, want / np.linalg.norm(want), rtol=0, atol=1e-5)
            assert out.outputs.hidden_size == stories_f32.config["hidden_size"]
            assert isinstance(out.outputs.embedding, list) and out.finished


def test_embeddings_alongside_generation_from_threads(stories_f32):
    prompts = [f"Story number {i} begins" for i in range(6)]
    alone_embed = [o.outputs.embedding for o in stories_f32.embed(prompts)]
    alone_text = texts(stories_f32.generate(prompts, GREEDY))
    got = {}
    workers = [threading.Thread(target=lambda: got.update(e=stories_f32.embed(prompts))),
               threading.Thread(target=lambda: got.update(g=stories_f32.generate(prompts, GREEDY)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert texts(got["g"]) == alone_text
    np.testing.assert_allclose([o.outputs.embedding for o in got["e"]], alone_embed, rtol=0, atol=1e-5)


def test_embed_bad_input(stories_f32):
    with pytest.raises(ValueError, match="pooling must be one of"):
        stories_f32.embed("hi", pooling="cls")
    with pytest.raises(ValueError):
        stories_f32.embed({"prompt_token_ids": []})


# ---- closing -----------------------------------------------------------------------------------

def thread_count():
    return len(os.listdir("/proc/self/task"))


def test_close_releases_the_engine_pool_and_threads():
    before = thread_count()
    with ferrum.LLM(STORIES, num_threads=4) as llm:
        out = texts(llm.generate("Once upon a time", GREEDY))
        running = thread_count()
        runner, engine = weakref.ref(llm.runner), weakref.ref(llm.engine.core)
    assert runner() is None and engine() is None
    assert thread_count() <= before < running  # the runner's workers are gone
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Once upon a time", GREEDY)
    assert llm.tokenizer.decode(llm.tokenizer.encode("Once upon a time")) == "Once upon a time"
    llm.close()  # twice is harmless
    assert texts(ferrum.LLM(STORIES, num_threads=4).generate("Once upon a time", GREEDY)) == out


# ---- configs that contradict themselves --------------------------------------------------------

def config_copy(tmp_path, **changes):
    d = tmp_path / "model"
    shutil.copytree(STORIES_FORMATS["safetensors"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("model_type, arch", [("gemma2", "LlamaForCausalLM"), ("llama", "Qwen2ForCausalLM"),
                                              ("llama", "LlamaForSequenceClassification")])
def test_model_type_contradicting_architectures_is_refused(tmp_path, model_type, arch):
    d = config_copy(tmp_path, model_type=model_type, architectures=[arch])
    with pytest.raises(ValueError, match=rf"config.json: model_type '{model_type}' and architectures "
                                         rf"\['{arch}'\] disagree"):
        ferrum.LLM(str(d), num_threads=1)


def test_either_field_alone_still_names_the_model(tmp_path):
    d = config_copy(tmp_path, architectures=["LlamaForCausalLM"])
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("model_type", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert ferrum.LLM(str(d), num_threads=1).config["arch"] == "llama"


# ---- paths and hub ids -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["./missing", "../missing/model", "~/missing.gguf", "/abs/missing", "missing.gguf",
                                  "models/tiny.gguf", "checkpoints/model.safetensors", "out/stories.bin",
                                  "a/b/c", "a\\b", "org//name", "org/name/"])
def test_paths_that_do_not_exist_are_file_not_found(monkeypatch, name):
    monkeypatch.setattr(models, "_download_from_hub", lambda *a: pytest.fail(f"{name!r} went to the hub"))
    with pytest.raises(FileNotFoundError, match="no model at") as e:
        models.resolve_model(name)
    assert ".." not in str(e.value).replace(name, "")


@pytest.mark.parametrize("name, repo, filename", [("org/name", "org/name", None),
                                                  ("org/name/file.gguf", "org/name", "file.gguf"),
                                                  ("org/name/sub/file.gguf", "org/name", "sub/file.gguf")])
def test_hub_ids_go_to_the_hub(monkeypatch, name, repo, filename):
    calls = []
    monkeypatch.setattr(models, "_download_from_hub", lambda *a: calls.append(a) or "downloaded")
    assert models.resolve_model(name) == "downloaded" and calls == [(repo, filename)]


def test_download_errors_have_one_period(monkeypatch):
    import huggingface_hub

    def refuse(*a, **k):
        raise OSError("Connection refused.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(RuntimeError) as e:
        models.resolve_model("org/name")
    assert "Connection refused. Pass a local path when offline." in str(e.value) and ".." not in str(e.value)


# ---- requests that cannot fit, and what ended one ----------------------------------------------

def test_a_request_that_can_never_fit_is_refused_saying_what_fits():
    """The KV cache holds the prompt and every generated token but the last; the context holds
    them all. At the limit the request runs to max_tokens; one token past it is refused at once."""
    ids = ferrum.LLM(STORIES).tokenizer.encode("Once upon a time")
    for kwargs, most, limit in (({"kv_cache_tokens": 32, "max_model_len": 64}, 32 - len(ids) + 1, "the KV cache holds 32 tokens"),
                                ({"kv_cache_tokens": 256, "max_model_len": 40}, 40 - len(ids), "max_model_len is 40")):
        llm = ferrum.LLM(STORIES, **kwargs)
        out = llm.generate({"prompt_token_ids": ids}, ferrum.SamplingParams(max_tokens=most, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == most and (out.finish_reason, out.length_limit) == ("length", "max_tokens")
        with pytest.raises(ValueError, match=rf"max_tokens={most + 1} cannot fit after a prompt of {len(ids)} tokens: "
                                             rf"{limit}, so at most {most} tokens can be generated"):
            llm.generate({"prompt_token_ids": ids}, ferrum.SamplingParams(max_tokens=most + 1))
        with pytest.raises(ValueError, match="cannot fit"):
            llm.add_request(ids, ferrum.SamplingParams(max_tokens=10**6))
        assert not llm.has_unfinished() and llm.stats()["kv_blocks_used"] == 0


def test_a_reply_cut_short_says_which_limit_it_reached():
    ids = ferrum.LLM(STORIES).tokenizer.encode("Once upon a time")
    unbounded = ferrum.SamplingParams(max_tokens=None, ignore_eos=True)
    for kwargs, limit, tokens in (({"kv_cache_tokens": 32}, "kv_cache", 32 - len(ids) + 1),
                                  ({"max_model_len": 24}, "max_model_len", 24 - len(ids))):
        llm = ferrum.LLM(STORIES, **kwargs)
        out = llm.generate({"prompt_token_ids": ids}, unbounded)[0].outputs[0]
        assert (out.finish_reason, out.length_limit, len(out.token_ids)) == ("length", limit, tokens)
        rid = llm.add_request(ids, unbounded)
        last = None
        while llm.has_unfinished():
            for d in llm.step():
                last = d.outputs[-1] if d.outputs else last
        assert (last.finish_reason, last.length_limit) == ("length", limit), rid
    llm = ferrum.LLM(STORIES)
    stopped = llm.generate("Once upon a time", ferrum.SamplingParams(max_tokens=64, stop=[" "]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.length_limit is None


def test_empty_inputs_are_refused(llm):
    for call in (lambda: llm.chat([]), lambda: llm.chat([[]]), lambda: llm.chat([[{"role": "user", "content": "hi"}], []]),
                 lambda: llm.generate([]), lambda: llm.generate(prompt_token_ids=[]), lambda: llm.embed([]),
                 lambda: llm.score([]), lambda: llm.generate({"prompt_token_ids": []})):
        with pytest.raises(ValueError):
            call()
    assert llm.stats()["kv_blocks_used"] == 0
