"""Prompts given as embeddings ({"prompt_embeds": float32 [tokens, hidden]}, enable_prompt_embeds):
rows equal to the model's own embedding rows compute exactly what the token ids do (f32 weights:
the same logits bit for bit, the same greedy tokens), alone, mixed with id prompts, chunked and
preempted; their cached blocks are shared only with the same rows; bad arrays are ValueErrors.
"""
import glob

import numpy as np
import pytest
from safetensors.numpy import load_file

import ferrum
from conftest import MODELS as SHARED_MODELS
from ferrum.tools.make_model import make_model

TOK = f"{SHARED_MODELS}/tokenizers/smollm2-135m-instruct"
rng = np.random.default_rng(11)
PROMPTS = [[int(t) for t in rng.integers(3, 49000, n)] for n in (5, 20, 37)]  # 1 to 3 KV blocks
GREEDY = ferrum.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random-weight f32 Llama (HF) and its embedding table."""
    path = make_model("llama", "tiny", "hf", "f32", seed=5, out=tmp_path_factory.mktemp("pe") / "hf",
                      num_layers=2, intermediate_size=128, vocab_size=49160)
    weights = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        weights.update(load_file(f))
    return str(path), weights["model.embed_tokens.weight"]


def open_llm(path, **kw):
    return ferrum.LLM(path, tokenizer=TOK, num_threads=1, enable_prompt_embeds=True, **kw)


@pytest.fixture(scope="module")
def llm(model):
    return open_llm(model[0])


def embeds(table, ids):
    return {"prompt_embeds": np.ascontiguousarray(table[ids])}


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_embedding_rows_give_the_ids_logits_bit_for_bit(model, llm):
    _, table = model
    for ids in PROMPTS:
        assert np.array_equal(llm.score(embeds(table, ids)), llm.score(ids))


def test_embedding_rows_on_opencl(model):
    path, table = model
    llm = open_llm(path, device="opencl")
    assert np.array_equal(llm.score(embeds(table, PROMPTS[2])), llm.score(PROMPTS[2]))
    mixed = [embeds(table, PROMPTS[0]), {"prompt_token_ids": PROMPTS[1]}]
    assert greedy(llm, mixed) == greedy(llm, [{"prompt_token_ids": ids} for ids in PROMPTS[:2]])


def test_greedy_continues_from_sampled_ids(model, llm):
    _, table = model
    by_ids = greedy(llm, [{"prompt_token_ids": ids} for ids in PROMPTS])
    assert greedy(llm, [embeds(table, ids) for ids in PROMPTS]) == by_ids
    out = llm.generate(embeds(table, PROMPTS[0]), GREEDY)[0]
    assert out.prompt_token_ids == [] and len(out.outputs[0].token_ids) == 10


def test_mixed_batches_equal_each_alone(model, llm):
    _, table = model
    mixed = [embeds(table, PROMPTS[0]), {"prompt_token_ids": PROMPTS[1]}, embeds(table, PROMPTS[2])]
    alone = [greedy(llm, [p])[0] for p in mixed]
    assert greedy(llm, mixed) == alone
    sampled = ferrum.SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    alone = [llm.generate([p], sampled)[0].outputs[0].token_ids for p in mixed]
    assert [o.outputs[0].token_ids for o in llm.generate(mixed, sampled)] == alone
    scores = llm.score([embeds(table, PROMPTS[2]), PROMPTS[1], embeds(table, PROMPTS[0])])
    for got, ids in zip(scores, [PROMPTS[2], PROMPTS[1], PROMPTS[0]]):
        assert np.array_equal(got, llm.score(embeds(table, ids)))


def test_chunked_equals_one_shot(model, llm):
    path, table = model
    chunked = open_llm(path, max_num_batched_tokens=8)
    for ids in PROMPTS:
        assert np.array_equal(chunked.score(embeds(table, ids)), llm.score(embeds(table, ids)))
    assert greedy(chunked, [embeds(table, ids) for ids in PROMPTS]) == greedy(llm, [embeds(table, ids) for ids in PROMPTS])


def test_preempted_equals_uninterrupted(model, llm):
    """A pool of 6 blocks for three prompts of 2-3 blocks each: the youngest are preempted and
    recomputed from their embedding rows."""
    path, table = model
    small = open_llm(path, kv_cache_tokens=96)
    prompts = [embeds(table, ids) for ids in PROMPTS[1:]] + [embeds(table, PROMPTS[2][:30])]
    params = ferrum.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.stats()["preemptions"] > 0
    assert got == [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def test_prefix_cache_shares_only_the_same_rows(model):
    path, table = model
    llm = open_llm(path)
    ids = PROMPTS[2]  # 37 tokens: 2 full blocks
    hits = lambda: llm.stats()["prefix_hit_tokens"]  # noqa: E731
    first = greedy(llm, [{"prompt_token_ids": ids}])
    assert greedy(llm, [embeds(table, ids)]) == first and hits() == 0  # the ids' blocks are not shared
    assert greedy(llm, [embeds(table, ids)]) == first and hits() == 32  # the same rows' are
    other = table[ids].copy()
    other[36] += 1.0  # past the cached blocks: a different prompt all the same
    greedy(llm, [{"prompt_embeds": other}])
    assert hits() == 32


def test_embed_returns_every_positions_hidden_state(model, llm):
    _, table = model
    ids = PROMPTS[1]
    by_ids, by_rows = llm.embed([{"prompt_token_ids": ids}, embeds(table, ids)], pooling="all", normalize=False)
    states = np.array(by_rows.outputs.embedding, dtype=np.float32)
    assert states.shape == (len(ids), table.shape[1]) and by_rows.outputs.hidden_size == table.shape[1]
    assert np.array_equal(states, np.array(by_ids.outputs.embedding, dtype=np.float32))
    last = llm.embed(embeds(table, ids), pooling="last")[0].outputs.embedding
    unit = llm.embed(embeds(table, ids), pooling="all")[0].outputs.embedding
    np.testing.assert_allclose(unit[-1], last, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, rtol=0, atol=1e-5)


def test_bad_prompt_embeds_are_value_errors(model, llm):
    path, table = model
    good = table[PROMPTS[0]]
    bad = {
        "float64": good.astype(np.float64),
        "1-D": good[0],
        "no rows": good[:0],
        "wrong width": np.ascontiguousarray(good[:, :32]),
        "NaN": np.where(np.arange(good.size).reshape(good.shape) == 7, np.nan, good).astype(np.float32),
        "infinity": np.where(np.arange(good.size).reshape(good.shape) == 3, np.inf, good).astype(np.float32),
        "a list": good.tolist(),
    }
    for name, arr in bad.items():
        for call in (lambda p: llm.generate(p, GREEDY), llm.score, llm.embed):
            with pytest.raises(ValueError):
                call({"prompt_embeds": arr})
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt_embeds": good, "prompt_token_ids": PROMPTS[0]}, GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": good}, ferrum.SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        ferrum.LLM(path, tokenizer=TOK, num_threads=1).generate({"prompt_embeds": good}, GREEDY)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        ferrum.LLM(path, tokenizer=TOK, num_threads=1, enable_prompt_embeds=1)
    assert greedy(llm, [{"prompt_embeds": good}]) == greedy(llm, [{"prompt_token_ids": PROMPTS[0]}])  # still serves
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


def test_prompt_lookup_speculation_follows_the_generated_ids(model, llm):
    path, table = model
    spec = open_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    params = ferrum.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [embeds(table, ids) for ids in PROMPTS]
    assert ([o.outputs[0].token_ids for o in spec.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert spec.stats()["spec_proposed_tokens"] > 0


def test_a_prompt_of_embeddings_that_can_never_fit_is_refused(model):
    """The up-front check counts a prompt's rows as its tokens, as it counts ids."""
    path, table = model
    small = open_llm(path, kv_cache_tokens=32)
    prompt = embeds(table, list(range(1, 11)))
    out = small.generate(prompt, ferrum.SamplingParams(max_tokens=23, temperature=0, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.length_limit) == (23, "max_tokens")
    with pytest.raises(ValueError, match="max_tokens=24 cannot fit after a prompt of 10 tokens"):
        small.generate(prompt, ferrum.SamplingParams(max_tokens=24))
