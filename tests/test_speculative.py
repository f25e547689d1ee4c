"""Speculative decoding: outputs as without it (greedy: token for token; sampled: the same
distribution), with both proposers, under batching, chunked prefill, prefix-cache hits,
preemption, aborts, and the request features that ride on sampling."""
import numpy as np
import pytest

import ferrum
import conftest
from conftest import STORIES_FORMATS, assert_pool_empty
from ferrum.speculative import NgramIndex, SpeculativeConfig
from ferrum.tools.gguf_weights import read_gguf_model
from ferrum.tools.make_model import from_dequantized, make_model

STORIES = STORIES_FORMATS["gguf"]
K = 5


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Two draft models for stories260K: the same model requantized to Q8_0 (it agrees with the
    target almost always) and a random one with its vocabulary (it rarely does)."""
    d = tmp_path_factory.mktemp("drafts")
    cfg, weights = read_gguf_model(STORIES)
    near = from_dequantized(weights, cfg, format="gguf", dtype="q8_0", out=d / "stories-q8_0.gguf")
    far = make_model("llama", "tiny", format="hf", seed=3, vocab_size=cfg.vocab_size, out=d / "random")
    return {"near": str(near), "far": str(far)}


def configs(drafts):
    return {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1},
            "draft-near": {"model": drafts["near"], "num_speculative_tokens": K},
            "draft-far": {"model": drafts["far"], "num_speculative_tokens": K}}


@pytest.fixture(scope="module", params=["ngram", "draft-near", "draft-far"])
def spec(request, drafts):
    return configs(drafts)[request.param]


def make_llm(speculative_config=None, **kw):
    kw.setdefault("kv_dtype", "f32")
    return ferrum.LLM(STORIES, num_threads=2, max_model_len=512, speculative_config=speculative_config, **kw)


def prompts(n, seed=0):
    """Prompts that repeat their own spans, so that prompt lookup finds something to propose."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        span = [int(t) for t in rng.integers(3, 512, rng.integers(3, 12))]
        out.append([1] + span * int(rng.integers(2, 5)) + [int(t) for t in rng.integers(3, 512, rng.integers(0, 20))])
    return out


GREEDY = ferrum.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def greedy_tokens(llm, ps, params=GREEDY):
    return conftest.greedy_tokens(llm, ps, params)


@pytest.fixture(scope="module")
def plain():
    llm = make_llm(enable_prefix_caching=False)
    return greedy_tokens(llm, prompts(16))


def test_greedy_outputs_equal_without_speculation_batched(spec, plain):
    llm = make_llm(spec)
    assert greedy_tokens(llm, prompts(16)) == plain
    st = llm.stats()
    assert st["spec_proposed_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert_pool_empty(llm)


def test_greedy_outputs_equal_with_chunked_prefill_and_prefix_hits(spec, plain):
    # A budget of 7 tokens chunks every prompt (and caps what a step verifies); the second
    # round hits the prefixes the first one cached.
    llm = make_llm(spec, max_num_batched_tokens=7)
    assert greedy_tokens(llm, prompts(16)) == plain
    assert greedy_tokens(llm, prompts(16)) == plain
    st = llm.stats()
    assert st["prefix_hit_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert_pool_empty(llm)


def test_greedy_outputs_equal_when_preempted_and_recomputed(spec, plain):
    # 10 blocks of 16 tokens cannot hold 16 sequences of up to ~110 tokens.
    llm = make_llm(spec, kv_cache_tokens=10 * 16, enable_prefix_caching=False)
    assert greedy_tokens(llm, prompts(16)) == plain
    st = llm.stats()
    assert st["preemptions"] > 0 and st["spec_accepted_tokens"] > 0
    assert_pool_empty(llm)


def test_acceptance_follows_how_well_the_proposer_knows_the_target(drafts):
    rates = {}
    for name, cfg in configs(drafts).items():
        llm = make_llm(cfg)
        greedy_tokens(llm, prompts(8, seed=4))
        rates[name] = llm.stats()["spec_acceptance_rate"]
    assert rates["draft-near"] > 0.9 and rates["draft-far"] < 0.5, rates


def test_logprobs_stops_seeds_n_and_a_request_turning_it_off_as_without(spec):
    """Greedy requests with logprobs, stop strings and n > 1, and seeded sampled ones, give the
    same tokens, texts and logprobs with and without speculation; a request may opt out."""
    base, llm = make_llm(), make_llm(spec)
    story = "Once upon a time, there was a little girl. She liked to play. Once upon a time"
    greedy = ferrum.SamplingParams(max_tokens=30, temperature=0, logprobs=3, stop=["park"], n=2)
    a = base.generate([story], greedy)[0]
    b = llm.generate([story], greedy)[0]
    for x, y in zip(a.outputs, b.outputs):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                       y.stop_reason)
        for sx, sy in zip(x.logprobs, y.logprobs):
            assert sx.keys() == sy.keys()
            assert all(abs(sx[t].logprob - sy[t].logprob) < 1e-4 for t in sx)
    seeded = ferrum.SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, n=2)
    first = [o.token_ids for o in llm.generate([story], seeded)[0].outputs]
    again = [o.token_ids for o in make_llm(spec).generate([story], seeded)[0].outputs]
    assert first == again and first[0] != first[1]  # reproducible, and the n completions differ
    before = llm.stats()["spec_proposed_tokens"]
    llm.generate([story], ferrum.SamplingParams(max_tokens=20, temperature=0, speculative_decoding=False))
    assert llm.stats()["spec_proposed_tokens"] == before
    assert_pool_empty(llm)


def test_incremental_api_with_random_aborts_frees_every_block(spec):
    llm = make_llm(spec, kv_cache_tokens=12 * 16)
    rng = np.random.default_rng(5)
    ids = []
    for step in range(400):
        if len(ids) < 40 and rng.random() < 0.3:
            params = ferrum.SamplingParams(max_tokens=int(rng.integers(1, 60)), ignore_eos=True,
                                           temperature=float(rng.choice([0.0, 0.9])))
            ids.append(llm.add_request(prompts(1, seed=step)[0], params))
        if ids and rng.random() < 0.05:
            llm.abort(ids[int(rng.integers(len(ids)))])
        llm.step()
    while llm.has_unfinished():
        llm.step()
    assert llm.stats()["spec_proposed_tokens"] > 0
    assert_pool_empty(llm)


def exact_second_token_distribution(llm, prompt, temperature):
    """P(token 2) = sum over t1 of P(t1) P(t2 | t1), from the target's own logits."""
    first = llm.score(prompt)[-1].astype(np.float64) / temperature
    p1 = np.exp(first - first.max())
    p1 /= p1.sum()
    seconds = llm.score([prompt + [t] for t in range(len(p1))])
    p2 = np.zeros_like(p1)
    for t, logits in enumerate(seconds):
        row = logits[-1].astype(np.float64) / temperature
        q = np.exp(row - row.max())
        p2 += p1[t] * q / q.sum()
    return p2


@pytest.mark.parametrize("name", ["ngram", "draft-far"])
def test_sampled_tokens_follow_the_target_distribution(drafts, name):
    """Chi-square goodness of fit of the second sampled token (the first one that speculation
    decides) against its exact distribution under the target, over 3000 seeded samples."""
    from scipy.stats import chisquare
    llm = make_llm(configs(drafts)[name])
    # Words the story repeats: what the model says next has often been said before.
    prompt = llm.tokenizer.encode("Lily saw a big dog. Lily saw a big cat. Lily saw a big bird. Lily saw a")
    temperature = 1.3  # a flat distribution: rejections and resampling both happen often
    expected = exact_second_token_distribution(llm, prompt, temperature)
    params = [ferrum.SamplingParams(max_tokens=2, temperature=temperature, seed=s, ignore_eos=True)
              for s in range(3000)]
    outs = llm.generate(prompt_token_ids=[prompt] * len(params), sampling_params=params)
    st = llm.stats()
    assert st["spec_proposed_tokens"] > 1000 and 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    counts = np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=len(expected)).astype(np.float64)
    # Categories expected fewer than 5 times are pooled into one.
    big = expected * len(outs) >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum()) * len(outs)
    assert chisquare(observed, wanted).pvalue > 1e-3


def lookup(tokens, k, lookup_max, lookup_min):
    index = NgramIndex(lookup_min, lookup_max)
    index.follow(list(tokens), [])
    return index.propose(k)


def test_prompt_lookup_takes_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    assert lookup(tokens, 3, 3, 1) == [1, 2, 5]  # "5 6 7" last seen before "1 2 5"
    assert lookup(tokens, 9, 3, 1)[:2] == [1, 2]
    assert lookup([1, 2, 3, 4], 3, 3, 1) == []
    assert lookup([1, 2, 3, 1], 2, 3, 1) == [2, 3]  # only a one-token match
    assert lookup([1, 2, 3, 1], 2, 3, 2) == []


def longest_match_by_scan(tokens, k, lookup_max, lookup_min):
    """The reference: every earlier end compared backwards with the suffix."""
    n, best, start = len(tokens), 0, None
    for end in range(n - 1):
        length = 0
        while length < min(lookup_max, n - 1) and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
            length += 1
        if length >= lookup_min and length >= best:  # the latest of the longest
            best, start = length, end + 1
    return [] if start is None else tokens[start:start + k]


@pytest.mark.parametrize("lookup_min,lookup_max", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_prompt_lookup_follows_a_growing_sequence_as_a_full_scan_does(lookup_min, lookup_max):
    rng = np.random.default_rng(lookup_min * 10 + lookup_max)
    for trial in range(20):
        prompt = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()  # few symbols: many matches
        output = []
        index = NgramIndex(lookup_min, lookup_max)
        for _ in range(25):
            k = int(rng.integers(1, 7))
            index.follow(prompt, output)
            assert index.propose(k) == longest_match_by_scan(prompt + output, k, lookup_max, lookup_min)
            output += rng.integers(0, 4, int(rng.integers(1, 4))).tolist()  # a step accepts 1-3 tokens


@pytest.mark.parametrize("config", [
    {"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "medusa", "num_speculative_tokens": 3}, {"num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
    {"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "{not json", 7,
])
def test_bad_speculative_configs_are_refused(config):
    with pytest.raises((ValueError, TypeError)):
        SpeculativeConfig.parse(config)


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path):
    other = make_model("llama", "tiny", format="hf", seed=1, vocab_size=300, out=tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm({"model": str(other), "num_speculative_tokens": 3})


def test_logits_processors_apply_to_every_verified_row(spec, plain):
    """A processor that bans the token plain decoding would give after each 7 makes outputs
    differ from `plain`; with speculation they still equal decoding without it."""
    def ban_after_seven(output_ids, logits):
        out = logits.copy()
        if output_ids and output_ids[-1] % 7 == 0:
            out[int(np.argmax(logits))] = -np.inf
        return out

    params = ferrum.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logits_processors=[ban_after_seven])
    want = greedy_tokens(make_llm(), prompts(8), params)
    assert want != plain[:8]
    llm = make_llm(spec)
    assert greedy_tokens(llm, prompts(8), params) == want
    assert llm.stats()["spec_proposed_tokens"] > 0
