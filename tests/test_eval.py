"""ferrum.eval: perplexity and log-likelihoods against transformers, batching invariants,
exact match, and bad input."""
import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ferrum
from conftest import STORIES, STORIES_FORMATS
from ferrum.eval import (exact_match, loglikelihood, normalize_answer, perplexity,
                         sliding_windows)

GPL3 = "/usr/share/common-licenses/GPL-3"
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big red ball under a tree. She ran to the ball and kicked it very hard. ")


def gpl3(chars):
    return open(GPL3, encoding="utf-8").read()[:chars]


@pytest.fixture(scope="module", autouse=True)
def torch_one_thread():
    """The transformers side runs single-threaded: its OpenMP workers spin while waiting, and on
    a busy 2-core machine two of them take ~10x longer than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stories():
    return ferrum.LLM(STORIES_FORMATS["safetensors"], kv_dtype="f32", num_threads=2,
                      tokenizer=os.path.join(STORIES, "tok512.bin"))


@pytest.fixture(scope="module")
def stories_hf():
    return AutoModelForCausalLM.from_pretrained(STORIES_FORMATS["safetensors"], dtype=torch.float32)


def hf_token_logprobs(model, ids, start):
    """float64 log P(ids[p] | ids[:p]) for p >= start, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[start - 1:len(ids) - 1]
    return lp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0].numpy()


def hf_perplexity(model, ids, window, stride):
    """The Hugging Face guide's sliding-window perplexity, computed with transformers."""
    nll, count = 0.0, 0
    for begin, end, first in sliding_windows(len(ids), window, stride):
        nll -= hf_token_logprobs(model, ids[begin:end], first - begin).sum()
        count += end - first
    return math.exp(nll / count), nll, count


# ---- sliding windows -------------------------------------------------------------------------

@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (10, 4, 4), (10, 4, 1), (100, 32, 7),
                                             (100, 200, 50), (257, 64, 32), (33, 32, 32)])
def test_sliding_windows_score_tokens_once_with_context(n, window, stride):
    spans = sliding_windows(n, window, stride)
    scored = [p for _, end, first in spans for p in range(first, end)]
    assert scored == sorted(set(scored)) and spans[-1][1] == n
    # Overlapping windows score every token but the first; disjoint ones (stride == window)
    # cannot score the first token of each window, which has no context there.
    expected = set(range(1, n)) - ({b for b, _, _ in spans} if stride == window else set())
    assert set(scored) == expected
    for i, (begin, end, first) in enumerate(spans):
        assert end - begin <= window and begin < first <= end
        if i:  # later windows keep window - stride tokens of context
            assert first - begin >= window - stride


# ---- perplexity against transformers ----------------------------------------------------------

@pytest.mark.parametrize("window,stride", [(512, 512), (256, 128), (100, 37)])
def test_perplexity_matches_transformers_stories260k(stories, stories_hf, window, stride):
    ids = stories.tokenizer.encode(gpl3(2500))
    assert len(ids) > 2 * window
    got = perplexity(stories, ids, window=window, stride=stride)
    ppl, nll, count = hf_perplexity(stories_hf, ids, window, stride)
    assert got.num_tokens == count == len(ids) - 1 - (got.num_windows - 1 if window == stride else 0)
    assert got.num_windows == len(sliding_windows(len(ids), window, stride))
    assert abs(got.nll - nll) / count < 1e-6, (got.nll, nll)
    assert abs(got.perplexity / ppl - 1) < 1e-5, (got.perplexity, ppl)


def test_perplexity_matches_transformers_smollm2(smollm2_path, smollm2_hf):
    """The real model: Q4_1 blocks dequantized by transformers vs consumed directly by ferrum."""
    llm = ferrum.LLM(smollm2_path, kv_dtype="f32", num_threads=2)
    ids = llm.tokenizer.encode(gpl3(600))
    got = perplexity(llm, ids, window=64, stride=32)
    ppl, nll, count = hf_perplexity(smollm2_hf, ids, 64, 32)
    assert got.num_tokens == count == len(ids) - 1 and got.num_windows >= 3
    assert abs(got.nll - nll) / count < 1e-5, (got.nll, nll)
    assert abs(got.perplexity / ppl - 1) < 1e-4, (got.perplexity, ppl)


def test_short_pairs_scored_together_match_transformers_smollm2(smollm2_path, smollm2_hf):
    """Forty short (context, continuation) pairs share forwards; scores compute with f32
    activations, as transformers does."""
    llm = ferrum.LLM(smollm2_path, kv_dtype="f32", num_threads=2)
    pairs = [(f"Item {i}: the capital of France is", " Paris") for i in range(40)]
    results = loglikelihood(llm, pairs)
    for (context, continuation), r in zip(pairs[::8], results[::8]):
        ids = llm.tokenizer.encode(context + continuation)
        start = len(ids) - r.num_tokens
        assert abs(r.logprob - hf_token_logprobs(smollm2_hf, ids, start).sum()) < 1e-3


def test_perplexity_of_text_equals_perplexity_of_its_tokens(stories):
    text = gpl3(1500)
    a = perplexity(stories, text, window=128, stride=64)
    b = perplexity(stories, stories.tokenizer.encode(text), window=128, stride=64)
    assert a == b


def test_defaults_are_the_context_length_and_half_of_it(stories):
    ids = stories.tokenizer.encode(gpl3(3000))
    n = stories.runner.max_model_len
    assert perplexity(stories, ids) == perplexity(stories, ids, window=n, stride=n // 2)


# ---- token log-probabilities: batching invariants ----------------------------------------------

def test_token_logprobs_batched_equal_alone_and_pool_is_freed(stories):
    base = stories.tokenizer.encode(STORY)
    seqs = [base, base[:9], base[4:], base[:20] + base[:20], base[:3]]
    starts = [1, 2, 7, 21, 2]
    batched = stories.token_logprobs(seqs, start=starts)
    for s, st, b in zip(seqs, starts, batched):
        alone = stories.token_logprobs(s, start=st)
        assert b.start == st and list(b.token_ids) == s[st:]
        np.testing.assert_allclose(b.logprobs, alone.logprobs, atol=2e-5)
        assert (b.greedy == alone.greedy).all()
        ref = hf_free_logprobs(stories.score(s), s, st)
        np.testing.assert_allclose(b.logprobs, ref, atol=2e-5)
    stats = stories.runner.stats()
    assert stats["kv_blocks_used"] == 0 and stats["sequences"] == 0


def hf_free_logprobs(logits, ids, start):
    """log-softmax of LLM.score's logits, picked at the next tokens (float64 numpy)."""
    x = logits.astype(np.float64)
    lp = x - x.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    return lp[np.arange(start - 1, len(ids) - 1), ids[start:]]


def test_token_logprobs_in_a_small_kv_pool_wait_for_room(stories):
    """Forty sequences of ~60 tokens in a pool of 256 tokens: admitted as blocks free up."""
    small = ferrum.LLM(STORIES_FORMATS["safetensors"], kv_dtype="f32", num_threads=2, kv_cache_tokens=256,
                       tokenizer=os.path.join(STORIES, "tok512.bin"))
    base = small.tokenizer.encode(STORY)
    seqs = [base[i % 7:i % 7 + 60] for i in range(40)]
    got = small.token_logprobs(seqs)
    want = stories.token_logprobs(seqs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-5)
    assert small.runner.stats()["kv_blocks_used"] == 0


def test_batched_score_equals_score_alone(stories):
    base = stories.tokenizer.encode(STORY)
    seqs = [base, base[5:30], [base[0]]]
    for s, logits in zip(seqs, stories.score(seqs)):
        np.testing.assert_allclose(logits, stories.score(s), atol=2e-5)


# ---- log-likelihood ------------------------------------------------------------------------------

def test_loglikelihood_matches_transformers_and_greedy_generation(stories, stories_hf):
    contexts = ["Once upon a time, there was a little", "One day, Lily went to the park. She saw a",
                "The cat and the dog were", "Tom had a big red"]
    greedy = stories.generate(contexts, ferrum.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    pairs = []
    for ctx, out in zip(contexts, greedy):
        pairs.append((stories.tokenizer.encode(ctx), out.outputs[0].token_ids))          # the greedy continuation
        pairs.append((stories.tokenizer.encode(ctx), out.outputs[0].token_ids[:2][::-1]))  # a likely non-greedy one
    results = loglikelihood(stories, pairs)
    for (ctx, cont), r in zip(pairs, results):
        ref = hf_token_logprobs(stories_hf, ctx + cont, len(ctx))
        assert r.num_tokens == len(cont)
        assert abs(r.logprob - ref.sum()) < 1e-4, (r.logprob, ref.sum())
    assert all(r.is_greedy for r in results[0::2])
    for (ctx, cont), r in zip(pairs[1::2], results[1::2]):
        want = stories.generate(prompt_token_ids=[ctx], sampling_params=ferrum.SamplingParams(
            max_tokens=len(cont), temperature=0, ignore_eos=True))[0].outputs[0].token_ids == cont
        assert r.is_greedy == want


def test_loglikelihood_of_text_pairs_splits_at_the_token_boundary(stories):
    context, continuation = "Once upon a time, there was a little", " girl named Lily."
    (r,) = loglikelihood(stories, [(context, continuation)])
    ids = stories.tokenizer.encode(context + continuation)
    ctx = stories.tokenizer.encode(context)
    start = next(i for i in range(len(ids)) if i >= len(ctx) or ids[i] != ctx[i])
    assert r.num_tokens == len(ids) - start
    assert abs(r.logprob - stories.token_logprobs(ids, start=start).total) < 1e-6


# ---- exact match ----------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,norm", [("The Paris.", "paris"), ("  William   SHAKESPEARE! ", "william shakespeare"),
                                      ("an apple, a pear", "apple pear"), ("ﬁve", "five"), ("H2O", "h2o")])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_compares_greedy_answers(stories):
    prompts = ["Once upon a time, there was a", "Lily saw a big", "The dog ran to the"]
    params = ferrum.SamplingParams(max_tokens=4, temperature=0, stop=["\n"])
    answers = [o.outputs[0].text for o in stories.generate(prompts, params)]
    items = [(prompts[0], answers[0]), (prompts[1], [answers[0], answers[1].upper() + "!"]),
             (prompts[2], answers[2] + " zebra")]
    result = exact_match(stories, items, max_tokens=4)
    assert [i.correct for i in result.items] == [True, True, False]
    assert [i.output for i in result.items] == answers
    assert result.accuracy == pytest.approx(2 / 3) and result.num_correct == 2
    first_word = answers[2].split()[0]
    assert exact_match(stories, [(prompts[2], first_word)], max_tokens=4, match="prefix").accuracy == 1
    assert exact_match(stories, [(prompts[2], first_word)], max_tokens=4, match="exact").accuracy == 0
    assert exact_match(stories, [(prompts[2], answers[2].split()[-1])], max_tokens=4, match="contains").accuracy == 1


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda llm: perplexity(llm, ""),
    lambda llm: perplexity(llm, [5]),
    lambda llm: perplexity(llm, [[1, 2], [3, 4]]),
    lambda llm: perplexity(llm, "some text here", window=1),
    lambda llm: perplexity(llm, "some text here", window=8, stride=9),
    lambda llm: perplexity(llm, "some text here", window=8, stride=0),
    lambda llm: perplexity(llm, "some text here", window=100_000),
    lambda llm: perplexity(llm, [1, 2, 9999]),
    lambda llm: loglikelihood(llm, []),
    lambda llm: loglikelihood(llm, [("context", "")]),
    lambda llm: loglikelihood(llm, [("context", [5])]),
    lambda llm: loglikelihood(llm, [([], [5])]),
    lambda llm: loglikelihood(llm, ["not a pair"]),
    lambda llm: exact_match(llm, []),
    lambda llm: exact_match(llm, [("prompt", "")]),
    lambda llm: exact_match(llm, [("prompt", "the")]),
    lambda llm: exact_match(llm, [("", "answer")]),
    lambda llm: exact_match(llm, [("prompt", "answer")], match="fuzzy"),
    lambda llm: llm.token_logprobs([1]),
    lambda llm: llm.token_logprobs([1, 2, 3], start=3),
    lambda llm: llm.token_logprobs([[1, 2, 3], [1, 2]], start=[1]),
])
def test_bad_input_raises_value_error(stories, call):
    with pytest.raises(ValueError):
        call(stories)
    assert stories.runner.stats()["sequences"] == 0


def test_import_ferrum_needs_no_test_only_package():
    """torch, transformers, pytest, nbclient... are test dependencies: `import ferrum` (with
    ferrum.eval) must not load them. Checked in a fresh interpreter."""
    import subprocess
    import sys
    code = ("import sys, ferrum, ferrum.eval, ferrum.scoring; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers', 'pytest', '_pytest', 'nbclient', 'nbformat', 'matplotlib'}))")
    out = subprocess.run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", code],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_scores_do_not_depend_on_chunking_batching_or_row_count(smollm2_path):
    """A score's logits are the same bits however its sequence is chunked (token budgets of 7 to
    512), batched (with others of any length before it) or cut (one token): on a quantized model
    with an f16 KV cache, where any difference in a K/V value would show."""
    ids = ferrum.LLM(smollm2_path, num_threads=2).tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    other = list(range(1000, 1037))
    alone = ferrum.LLM(smollm2_path, num_threads=2, enable_prefix_caching=False)
    want = alone.score(ids)
    for budget in (7, 16, 33, 64):
        llm = ferrum.LLM(smollm2_path, num_threads=2, enable_prefix_caching=False, max_num_batched_tokens=budget)
        np.testing.assert_array_equal(llm.score(ids), want)
    for k in (1, 5, 17, 36):
        np.testing.assert_array_equal(alone.score([other[:k], ids])[1], want)
    np.testing.assert_array_equal(alone.score(ids[:1]), want[:1])
