"""Tests for ferrum.sampling, ferrum.stop and ferrum.outputs (pure numpy, no _core)."""
import math

import numpy as np
import pytest

from ferrum.outputs import CompletionOutput, Logprob, RequestOutput
from ferrum.sampling import Sampler, SamplingParams, SamplingState
from ferrum.stop import RequestProgress, StopChecker


# ---------------------------------------------------------------- helpers

def chi2_survival(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper
    incomplete gamma Q(df/2, statistic/2), by series or continued fraction."""
    a, x = df / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series for the lower function P, then Q = 1 - P
        term = total = 1.0 / a
        denom = a
        while abs(term) > 1e-15 * abs(total):
            denom += 1
            term *= x / denom
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # Lentz's continued fraction for Q.
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * h


def test_chi2_survival_matches_known_values():
    # Textbook critical values: P(chi2_df >= value) = 0.05 / 0.001.
    assert chi2_survival(3.841, 1) == pytest.approx(0.05, abs=2e-4)
    assert chi2_survival(18.307, 10) == pytest.approx(0.05, abs=2e-4)
    assert chi2_survival(29.588, 10) == pytest.approx(0.001, abs=2e-5)
    assert chi2_survival(4.0, 4) == pytest.approx(math.exp(-2) * 3)  # closed form for df=4


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Plain-Python filtered distribution for one row, written independently."""
    z = [v / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order)
    if top_k > 0:
        kth = z[order[min(top_k, len(z)) - 1]]
        keep = {i for i in keep if z[i] >= kth}

    def normalised(kept):
        weights = {i: math.exp(z[i]) for i in kept}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    probs = normalised(keep)
    if top_p < 1.0:
        mass, kept = 0.0, set()
        for i in order:
            if i in probs and mass < top_p:
                kept.add(i)
                mass += probs[i]
        probs = normalised(kept)
    if min_p > 0:
        threshold = min_p * max(probs.values())
        kept = {i for i, p in probs.items() if p >= threshold}
        probs = {i: probs[i] / sum(probs[j] for j in kept) for i in kept}
    return np.array([probs.get(i, 0.0) for i in range(len(z))])


def run_steps(sampler, logits_fn, states, steps):
    """Sample ``steps`` tokens for each state (appending them), return [steps, B]."""
    picked = []
    for step in range(steps):
        result = sampler.sample(logits_fn(step, len(states)), states)
        for state, token in zip(states, result.token_ids):
            state.append(token)
        picked.append(result.token_ids.copy())
    return np.array(picked)


# A fixed, unsorted 12-token vocabulary with distinct logits.
LOGITS_12 = np.array([0.3, 1.9, -0.7, 1.1, 0.0, -1.4, 1.5, 0.6, -0.2, 0.9, -1.0, 1.3],
                     dtype=np.float32)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs", [
    dict(n=0), dict(n=1.5), dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.0),
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_p=0.0), dict(top_p=1.01), dict(top_p=-0.5),
    dict(top_k=-2), dict(top_k=2.5),
    dict(min_p=-0.01), dict(min_p=1.5),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
    dict(repetition_penalty=float("inf")),
    dict(presence_penalty=2.5), dict(presence_penalty=-2.01), dict(frequency_penalty=3.0),
    dict(frequency_penalty=float("nan")),
    dict(logprobs=-1), dict(logprobs=1.5),
    dict(stop=5), dict(stop=["ok", 3]), dict(stop=[""]), dict(stop=b"bytes"),
    dict(stop_token_ids=[1, "2"]), dict(stop_token_ids=[1.0]), dict(stop_token_ids="12"),
    dict(stop_token_ids=[-1]),
    dict(logit_bias={"5": 1.0}), dict(logit_bias={5: float("inf")}), dict(logit_bias={5: "x"}),
    dict(logit_bias=[(5, 1.0)]),
    dict(seed=1.5), dict(seed="42"),
])
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_valid_params_are_normalised():
    params = SamplingParams(stop="###", top_k=-1, max_tokens=None, stop_token_ids=(7, np.int64(9)),
                            logit_bias={np.int32(3): 2}, seed=-5, temperature=0)
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.max_tokens is None
    assert params.stop_token_ids == [7, 9]
    assert params.logit_bias == {3: 2.0}
    assert params.greedy
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax_with_first_maximum_on_ties():
    logits = np.array([[0.1, 3.0, -1.0, 3.0],
                       [5.0, 5.0, 5.0, 5.0],
                       [-2.0, -1.0, -3.0, -1.0]], dtype=np.float32)
    states = [SamplingState(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler().sample(logits, states).token_ids.tolist() == [1, 0, 1]


def test_plain_greedy_batch_equals_the_general_path():
    """A batch of greedy rows with no logits processor takes the argmax of the f32 logits
    directly; the result equals the general path (float64 copy), ties, -inf and NaN rows included."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[1, [7, 500]] = logits[1].max() + 1   # a tie at the top: the first wins
    logits[2] = -np.inf
    logits[3, [10, 20]] = np.nan
    logits[4, 999] = np.float32(3e38)
    plain = [SamplingState(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert all(st.params.plain_greedy for st in plain)
    fast = Sampler().sample(logits, plain)
    # a zero logit bias (a processor that changes nothing) sends every row through process_logits
    general = Sampler().sample(logits, [SamplingState(SamplingParams(temperature=0.0, logit_bias={0: 0.0}))
                                        for _ in range(6)])
    np.testing.assert_array_equal(fast.token_ids, general.token_ids)
    assert fast.token_ids.dtype == np.int64 and fast.token_ids[1] == 7 and fast.token_ids[3] == 10
    assert fast.logprobs == [None] * 6
    with pytest.raises(ValueError, match="logits must be"):
        Sampler().sample(logits, plain[:5])


def test_greedy_uses_penalised_logits_and_ignores_filters():
    logits = np.array([[2.0, 1.9, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=0.0, logit_bias={1: 0.5}, top_k=1, top_p=0.1)
    assert Sampler().sample(logits, [SamplingState(params)]).token_ids.tolist() == [1]


# ---------------------------------------------------------------- distributions

@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_distribution_matches_filtered_softmax(settings):
    draws = 20_000
    expected = reference_probs(LOGITS_12.astype(np.float64), **settings)
    # One seeded state repeated on every row: each row consumes the next
    # uniform of that one generator, so this is 20k independent draws.
    state = SamplingState(SamplingParams(seed=1234, **settings))
    tokens = Sampler().sample(np.tile(LOGITS_12, (draws, 1)), [state] * draws).token_ids
    counts = np.bincount(tokens, minlength=len(LOGITS_12))

    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "a filtered-out token was sampled"
    expected_counts = expected[allowed] * draws
    assert expected_counts.min() >= 5, "chi-square needs >= 5 expected per cell"
    statistic = float(((counts[allowed] - expected_counts) ** 2 / expected_counts).sum())
    df = int(allowed.sum()) - 1
    if df == 0:
        return
    p_value = chi2_survival(statistic, df)
    assert p_value > 1e-3, f"chi2={statistic:.2f}, df={df}, p={p_value:.2e}"


def test_filters_remove_the_right_tokens():
    # top_k keeps exactly k distinct-valued tokens; top_k=1 is argmax.
    assert (reference_probs(LOGITS_12, top_k=5) > 0).sum() == 5
    state = SamplingState(SamplingParams(top_k=1, seed=0))
    tokens = Sampler().sample(np.tile(LOGITS_12, (500, 1)), [state] * 500).token_ids
    assert set(tokens.tolist()) == {int(np.argmax(LOGITS_12))}


def test_top_k_keeps_boundary_ties():
    logits = np.array([[2.0, 1.0, 1.0, 1.0, -5.0]])
    state = SamplingState(SamplingParams(top_k=2, seed=3))
    tokens = Sampler().sample(np.repeat(logits, 3000, axis=0), [state] * 3000).token_ids
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_logits_with_minus_inf_are_never_sampled():
    logits = np.array([[0.5, -np.inf, 0.2, -np.inf]], dtype=np.float32)
    state = SamplingState(SamplingParams(temperature=1.5, top_p=0.95, seed=9))
    tokens = Sampler().sample(np.repeat(logits, 2000, axis=0), [state] * 2000).token_ids
    assert set(tokens.tolist()) <= {0, 2}


# ---------------------------------------------------------------- seeds

def _random_logits(vocab):
    table = np.random.default_rng(77).normal(0, 2, size=(64, vocab)).astype(np.float32)
    return lambda step, batch: np.tile(table[step], (batch, 1))


def test_same_seed_gives_same_sequence():
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=2024, repetition_penalty=1.1)
    runs = [run_steps(Sampler(), _random_logits(50), [SamplingState(params, [1, 2])], 30)[:, 0]
            for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()
    other = run_steps(Sampler(), _random_logits(50),
                      [SamplingState(SamplingParams(temperature=0.9, top_p=0.95, seed=2025,
                                                    repetition_penalty=1.1), [1, 2])], 30)[:, 0]
    assert other.tolist() != runs[0].tolist()


def test_seeded_request_is_independent_of_batch_composition():
    vocab, steps = 40, 25
    params = SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=99, frequency_penalty=0.4)
    logits_fn = _random_logits(vocab)
    alone = run_steps(Sampler(), logits_fn, [SamplingState(params, [3, 4])], steps)[:, 0]

    for position in (0, 2, 4):
        noise = [SamplingState(SamplingParams(temperature=1.2, presence_penalty=0.5))
                 for _ in range(4)]
        noise.insert(1, SamplingState(SamplingParams(temperature=0.0)))  # a greedy neighbour
        states = noise[:position] + [SamplingState(params, [3, 4])] + noise[position:]
        batched = run_steps(Sampler(), logits_fn, states, steps)[:, position]
        assert batched.tolist() == alone.tolist(), f"differs at batch position {position}"


def test_completions_of_one_seeded_request_differ_by_index():
    params = SamplingParams(seed=5)
    logits_fn = _random_logits(30)
    first = run_steps(Sampler(), logits_fn, [SamplingState(params, index=0)], 20)[:, 0]
    second = run_steps(Sampler(), logits_fn, [SamplingState(params, index=1)], 20)[:, 0]
    assert first.tolist() != second.tolist()


# ---------------------------------------------------------------- penalties

def test_bias_and_penalties_on_a_hand_computed_case():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]], dtype=np.float32)
    params = SamplingParams(logit_bias={5: 1.5, 0: -0.5}, repetition_penalty=2.0,
                            presence_penalty=0.3, frequency_penalty=0.2)
    state = SamplingState(params, prompt_token_ids=[0, 1])
    for token in (2, 2, 3):
        state.append(token)
    # bias:        [1.5, -1, 0.5, -0.5, 1, 1.5]
    # repetition on {0,1,2,3}: positive / 2, negative * 2 -> [0.75, -2, 0.25, -1, 1, 1.5]
    # output counts {2: 2, 3: 1}: token 2: 0.25 - 2*0.2 - 0.3; token 3: -1 - 0.2 - 0.3
    expected = [0.75, -2.0, -0.45, -1.5, 1.0, 1.5]
    processed = Sampler().process_logits(logits, [state])
    np.testing.assert_allclose(processed[0], expected, atol=1e-12)
    assert logits[0, 0] == 2.0, "the caller's logits must not be modified"


def test_presence_frequency_only_count_output_tokens():
    logits = np.zeros((1, 4), dtype=np.float32)
    state = SamplingState(SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
                          prompt_token_ids=[0, 0, 1])
    state.append(1)
    np.testing.assert_allclose(Sampler().process_logits(logits, [state])[0], [0, -1.5, 0, 0])


def test_penalties_apply_per_row_only():
    logits = np.tile(np.array([1.0, -1.0, 2.0], dtype=np.float32), (3, 1))
    plain = SamplingState(SamplingParams(), prompt_token_ids=[0, 1, 2])
    repeated = SamplingState(SamplingParams(repetition_penalty=4.0), prompt_token_ids=[1])
    biased = SamplingState(SamplingParams(logit_bias={0: -3.0}))
    processed = Sampler().process_logits(logits, [plain, repeated, biased])
    np.testing.assert_allclose(processed, [[1, -1, 2], [1, -4, 2], [-2, -1, 2]])


def test_out_of_vocab_ids_are_rejected():
    with pytest.raises(ValueError):
        Sampler().process_logits(np.zeros((1, 4)), [SamplingState(SamplingParams(logit_bias={9: 1}))])
    with pytest.raises(ValueError):
        Sampler().process_logits(np.zeros((1, 4)), [SamplingState(
            SamplingParams(repetition_penalty=1.5), prompt_token_ids=[4])])
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 4)), [SamplingState(SamplingParams())])


# ---------------------------------------------------------------- logprobs

def test_logprobs_come_from_raw_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, 30)).astype(np.float32)
    states = [
        SamplingState(SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5,
                                     logit_bias={3: 4.0}, seed=1), [0, 1, 2]),
        SamplingState(SamplingParams(logprobs=0, seed=2)),
        SamplingState(SamplingParams(seed=3)),  # no logprobs asked
        SamplingState(SamplingParams(logprobs=2, temperature=0.0)),
    ]
    result = Sampler().sample(logits, states)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    assert result.logprobs[2] is None
    for row, k in ((0, 5), (1, 0), (3, 2)):
        info = result.logprobs[row]
        chosen = int(result.token_ids[row])
        assert info.token_id == chosen
        assert info.logprob == pytest.approx(log_softmax[row, chosen], abs=1e-9)
        assert info.rank == 1 + int((log_softmax[row] > log_softmax[row, chosen]).sum())
        assert len(info.top) == k
        values = [lp.logprob for lp in info.top.values()]
        assert values == sorted(values, reverse=True)
        assert list(info.top) == np.argsort(-log_softmax[row])[:k].tolist()
        assert [lp.rank for lp in info.top.values()] == list(range(1, k + 1))
        np.testing.assert_allclose(values, np.sort(log_softmax[row])[::-1][:k], atol=1e-9)
        step = info.as_step_logprobs()
        assert chosen in step and set(info.top) <= set(step)
        assert len(step) in (k, k + 1)
    assert result.logprobs[3].rank == 1  # greedy picks the raw argmax here


# ---------------------------------------------------------------- stop handling

def drive(progress, deltas, token_ids=None):
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    emitted, last = [], None
    for token, delta in zip(token_ids, deltas):
        last = progress.append(token, delta)
        emitted.append(last[0])
        if last[1]:
            break
    return emitted, last


def test_stop_string_across_token_boundaries():
    progress = RequestProgress(SamplingParams(stop="lo w", max_tokens=50))
    emitted, (_, finished, reason) = drive(progress, ["Hel", "lo wo", "rld"])
    assert finished and reason == "stop"
    assert "".join(emitted) == "Hel" == progress.text
    assert emitted == ["He", "l"]  # "l" was held back: it might start "lo w"
    out = progress.to_output()
    assert out.text == "Hel" and out.finish_reason == "stop" and out.stop_reason == "lo w"
    assert out.token_ids == [100, 101]
    with pytest.raises(RuntimeError):
        progress.append(5, "x")


def test_earliest_stop_string_wins():
    progress = RequestProgress(SamplingParams(stop=["world", "o w", "xyz"]))
    emitted, (_, finished, _) = drive(progress, ["Hello", " world"])
    assert finished and progress.text == "Hell" and progress.stop_reason == "o w"
    checker = StopChecker(["cd", "bcd", "b"])
    assert checker.find("abcdef") == (1, "b")  # same start: the shorter completed first
    assert StopChecker(["cd", "bcd"]).find("abcdef") == (1, "bcd")


def test_streaming_holds_back_possible_stop_prefixes():
    progress = RequestProgress(SamplingParams(stop=["</end>", "STOP"], max_tokens=100))
    emitted, (_, finished, _) = drive(progress, ["abc<", "/e", "x and S", "TO", "P!"])
    # "<" and "</e" could start "</end>"; "S", "STO" could start "STOP".
    assert emitted[:4] == ["abc", "", "</ex and ", ""]
    assert finished and progress.text == "abc</ex and "
    # A held-back prefix that is not completed is released at the end.
    progress = RequestProgress(SamplingParams(stop="STOP", max_tokens=2))
    emitted, (_, finished, reason) = drive(progress, ["go S", "T"])
    assert emitted == ["go ", "ST"] and reason == "length"


def test_safe_length():
    checker = StopChecker(["abc", "bd"])
    assert checker.safe_length("xxab") == 2
    assert checker.safe_length("xxb") == 2
    assert checker.safe_length("xxc") == 3
    assert StopChecker([]).safe_length("anything") == 8


def test_stop_token_ids_and_eos():
    params = SamplingParams(stop_token_ids=[7], max_tokens=10)
    progress = RequestProgress(params, eos_token_ids=2)
    emitted, (_, finished, reason) = drive(progress, ["a", "b", "<x>"], [5, 6, 7])
    assert (finished, reason, progress.stop_reason) == (True, "stop", 7)
    assert progress.text == "ab" and progress.token_ids == [5, 6, 7]

    progress = RequestProgress(params, eos_token_ids=[2, 3])
    _, (_, finished, reason) = drive(progress, ["a", "</s>"], [5, 3])
    assert finished and reason == "stop" and progress.stop_reason is None and progress.text == "a"

    ignoring = RequestProgress(SamplingParams(ignore_eos=True, max_tokens=3), eos_token_ids=2)
    emitted, (_, finished, reason) = drive(ignoring, ["a", "</s>", "b"], [5, 2, 6])
    assert emitted == ["a", "</s>", "b"] and reason == "length"


def test_max_tokens_gives_length_and_none_means_unbounded():
    progress = RequestProgress(SamplingParams(max_tokens=3))
    emitted, (_, finished, reason) = drive(progress, ["a", "b", "c", "d"])
    assert emitted == ["a", "b", "c"] and finished and reason == "length"

    unbounded = RequestProgress(SamplingParams(max_tokens=None))
    emitted, (_, finished, _) = drive(unbounded, ["x"] * 200)
    assert not finished and len(emitted) == 200
    assert unbounded.finish("length") == "" and unbounded.finish_reason == "length"


def test_progress_collects_logprobs_into_a_completion_output():
    logits = np.log(np.array([[0.5, 0.25, 0.25]]))
    params = SamplingParams(logprobs=1, temperature=0.0, max_tokens=2)
    state, progress = SamplingState(params), RequestProgress(params, index=1)
    sampler = Sampler()
    for _ in range(2):
        result = sampler.sample(logits, [state])
        token = int(result.token_ids[0])
        state.append(token)
        progress.append(token, "x", result.logprobs[0])
    out = progress.to_output()
    assert isinstance(out, CompletionOutput) and out.index == 1 and out.finished()
    assert out.cumulative_logprob == pytest.approx(2 * math.log(0.5))
    assert out.logprobs == [{0: Logprob(math.log(0.5), 1)}] * 2
    assert RequestProgress(SamplingParams()).to_output().cumulative_logprob is None

    request = RequestOutput("r1", "hi", [1, 2], [out], finished=True)
    assert request.outputs[0].text == "xx"


def test_pooled_top_k_top_p_matches_a_full_sort():
    # Rows of varied peakiness so some nuclei fit the pool and some need the
    # wider tiers; a pool of 8 forces 8 -> 128 -> 2048 -> full vocabulary.
    from ferrum.sampling import _mask_top_k_top_p
    rng = np.random.default_rng(11)
    vocab = 3000
    logits = rng.normal(0, 1, size=(6, vocab)) * np.array([[0.2], [1], [3], [6], [1], [3]])
    top_k = np.array([0, 0, 0, 0, 40, 500])
    top_p = np.array([0.9, 0.5, 0.95, 0.99, 0.8, 1.0])
    pooled = _mask_top_k_top_p(logits.copy(), top_k, top_p, pool_size=8)
    full = _mask_top_k_top_p(logits.copy(), top_k, top_p, pool_size=vocab)
    np.testing.assert_array_equal(np.isfinite(pooled), np.isfinite(full))
    for row in range(6):  # and both agree with the plain reference
        expected = reference_probs(logits[row], top_k=int(top_k[row]), top_p=float(top_p[row])) > 0
        np.testing.assert_array_equal(np.isfinite(full[row]), expected)
    assert 1 < np.isfinite(full).sum(axis=1).min() and np.isfinite(full).sum(axis=1).max() > 128


def test_logits_processors_see_the_history_and_shape_the_draw():
    seen = []

    def only_even_after_history(output_ids, logits):
        seen.append(list(output_ids))
        out = logits.copy()
        out[1::2] = -np.inf
        return out

    def three_args(prompt_ids, output_ids, logits):
        assert list(prompt_ids) == [4, 5]
        out = np.full_like(logits, -np.inf)
        out[len(output_ids) + 2] = 0.0  # forces a token of its own choosing
        return out

    rng = np.random.default_rng(0)
    state = SamplingState(SamplingParams(temperature=1.0, seed=3, logits_processors=[only_even_after_history]))
    forced = SamplingState(SamplingParams(temperature=0.0, logits_processors=[three_args]), [4, 5])
    for step in range(5):
        result = Sampler().sample(rng.normal(size=(2, 50)).astype(np.float32), [state, forced])
        assert result.token_ids[0] % 2 == 0 and result.token_ids[1] == step + 2
        state.append(int(result.token_ids[0]))
        forced.append(int(result.token_ids[1]))
    assert seen[-1] == state.output_token_ids[:-1]
    with pytest.raises(ValueError):
        SamplingParams(logits_processors=[5])
