"""Rung 5: engine invariants on a real model (stories260K), on every backend, plus OpenCL == CPU
and a soak test."""
import numpy as np
import pytest

import ferrum
import conftest
from conftest import STORIES_FORMATS, assert_pool_empty

GREEDY = ferrum.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


DEVICES = ["cpu", "opencl"]


def make_llm(device="cpu", **kw):
    kw.setdefault("kv_dtype", "f32")
    return ferrum.LLM(STORIES_FORMATS["gguf"], device=device, num_threads=2, max_model_len=512, **kw)


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, 512, rng.integers(1, 90))] for _ in range(n)]


def greedy_tokens(llm, ps, params=GREEDY):
    return conftest.greedy_tokens(llm, ps, params)


@pytest.fixture(scope="module")
def alone(device):
    llm = make_llm(device, enable_prefix_caching=False)
    return {i: greedy_tokens(llm, [p])[0] for i, p in enumerate(prompts(16))}


def test_batch_of_16_equals_alone(device, alone):
    llm = make_llm(device, enable_prefix_caching=False)
    assert greedy_tokens(llm, prompts(16)) == [alone[i] for i in range(16)]
    assert_pool_empty(llm)


def test_chunked_prefill_equals_one_shot(device, alone):
    llm = make_llm(device, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert greedy_tokens(llm, prompts(16)) == [alone[i] for i in range(16)]
    assert_pool_empty(llm)


def test_prefix_cache_hit_equals_miss(device):
    base = prompts(1, seed=5)[0] * 3  # > 3 blocks
    shared = [base + [7, 8, 9], base + [10], base[:40]]
    miss = greedy_tokens(make_llm(device, enable_prefix_caching=False), shared)
    llm = make_llm(device)
    first = greedy_tokens(llm, shared)
    second = greedy_tokens(llm, shared)  # every prompt now hits cached blocks
    assert first == miss and second == miss
    st = llm.stats()
    assert st["prefix_hit_tokens"] > 0 and 0 < st["prefix_cache_hit_rate"] < 1
    assert_pool_empty(llm)


def test_preempted_and_recomputed_equals_uninterrupted(device, alone):
    # 12 blocks of 16 tokens cannot hold 16 sequences of up to ~110 tokens: preemption is forced.
    llm = make_llm(device, enable_prefix_caching=False, kv_cache_tokens=12 * 16)
    assert greedy_tokens(llm, prompts(16)) == [alone[i] for i in range(16)]
    assert llm.stats()["preemptions"] > 0
    assert_pool_empty(llm)


def test_replay_equals_eager(device):
    llm = make_llm(device)
    ps = prompts(4, seed=3)
    replayed = greedy_tokens(llm, ps)
    llm.runner.set_replay(False)
    assert greedy_tokens(llm, ps) == replayed


# Max abs logit error vs an f32 KV cache on this model (logits span about +-17; head_dim is
# only 8, so one int8 scale per 8-element row is coarse): f16 measured 0.025, int8 0.96.
@pytest.mark.parametrize("kv_dtype,bound,agree", [("f16", 0.05, 1.0), ("int8", 1.5, 0.9)])
def test_low_precision_kv_logits_close_to_f32(device, kv_dtype, bound, agree):
    ids = prompts(1, seed=9)[0]
    ref = make_llm(device).score(ids)
    got = make_llm(device, kv_dtype=kv_dtype).score(ids)
    assert np.abs(got - ref).max() < bound
    assert (got.argmax(1) == ref.argmax(1)).mean() >= agree


def test_score_matches_generation_logits(device):
    llm = make_llm(device)
    ids = prompts(1, seed=2)[0]
    logits = llm.score(ids)
    assert logits.shape == (len(ids), llm.config["vocab_size"]) and logits.dtype == np.float32
    out = llm.generate(prompt_token_ids=[ids], sampling_params=ferrum.SamplingParams(max_tokens=1, temperature=0))
    assert out[0].outputs[0].token_ids[0] == int(logits[-1].argmax())


def test_seeded_sampling_independent_of_batch(device):
    llm = make_llm(device)
    p = ferrum.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone_out = greedy_tokens(llm, [prompts(1, 4)[0]], p)[0]
    others = ferrum.SamplingParams(max_tokens=16, temperature=1.0)
    outs = llm.generate(prompt_token_ids=prompts(5, 7)[:2] + [prompts(1, 4)[0]] + prompts(5, 8)[:2],
                        sampling_params=[others, others, p, others, others])
    assert outs[2].outputs[0].token_ids == alone_out


# stories260K's weights are f32, so the two backends differ only in summation order: greedy
# continuations must agree token for token, and logits closely. f32 KV: max |diff| ~1.5e-5 on
# logits spanning +-19. f16 / int8 KV: where the backends' f32 K/V values (1e-7 apart) straddle
# a rounding boundary of the stored format, an element differs by one f16 ulp / one int8 step,
# which moves logits by up to 7.4e-3 (f16) / 1.2e-2 (int8) over these 16 prompts -- far under
# each format's own error against f32 KV (f16 up to 5.8e-2, int8 0.2 .. 1.4).
@pytest.mark.parametrize("kv_dtype,bound", [("f32", 1e-3), ("f16", 2e-2), ("int8", 5e-2)])
def test_opencl_equals_cpu(kv_dtype, bound):
    ps = prompts(16, seed=21)
    cpu, ocl = make_llm("cpu", kv_dtype=kv_dtype), make_llm("opencl", kv_dtype=kv_dtype)
    assert greedy_tokens(ocl, ps) == greedy_tokens(cpu, ps)
    for ids in ps:
        assert np.abs(ocl.score(ids) - cpu.score(ids)).max() < bound
    assert_pool_empty(ocl)


def test_soak_random_requests_aborts_and_small_pool():
    """1000 requests, random lengths / params / aborts, a small pool: all end cleanly and every
    block is free afterwards."""
    rng = np.random.default_rng(11)
    llm = make_llm(kv_cache_tokens=40 * 16, max_num_seqs=16)
    pending, finished, aborted = set(), 0, 0
    submitted = 0
    while submitted < 1000 or llm.has_unfinished():
        while submitted < 1000 and len(pending) < 24:
            n = int(rng.integers(1, 120))
            params = ferrum.SamplingParams(
                max_tokens=int(rng.integers(1, 20)), temperature=float(rng.choice([0, 0.5, 1.0])),
                top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                seed=int(rng.integers(0, 100)) if rng.random() < 0.5 else None,
                n=int(rng.choice([1, 1, 2])))
            pending.add(llm.add_request([1] + [int(t) for t in rng.integers(3, 512, n)], params))
            submitted += 1
        for out in llm.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                finished += 1
                assert all(o.finish_reason in ("stop", "length") for o in out.output.outputs)
            elif out.finished:  # one we aborted
                assert {o.finish_reason for o in out.output.outputs} <= {"abort", "stop", "length"}
        if pending and rng.random() < 0.05:
            victim = sorted(pending)[int(rng.integers(0, len(pending)))]
            llm.abort(victim)
            pending.discard(victim)
            aborted += 1
    assert finished + aborted == 1000 and not pending
    assert llm.stats()["preemptions"] > 0
    assert_pool_empty(llm)


# ---- the incremental serving API ----

def collect(llm, ids, early=()):
    """Steps until every request in ids finished; per request, the concatenated text and token
    deltas of completion 0 (after those in `early`) and the final output."""
    text = {r: "" for r in ids}
    tokens = {r: [] for r in ids}
    final = {}
    deltas = list(early)
    while True:
        for d in deltas:
            for c in d.outputs:
                if c.index == 0:
                    text[d.request_id] += c.text
                    tokens[d.request_id] += c.token_ids
            if d.finished:
                assert d.output.finished and d.output.request_id == d.request_id
                final[d.request_id] = d.output
        if len(final) == len(ids):
            return text, tokens, final
        deltas = llm.step()


def test_requests_added_while_others_run_equal_generate(alone):
    llm = make_llm()
    ps = prompts(6)
    ids = [llm.add_request(ps[0], GREEDY), llm.add_request(ps[1], GREEDY, request_id="second")]
    assert ids[1] == "second"
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request(ps[2], GREEDY, request_id="second")
    early = llm.step() + llm.step()  # two steps before the rest arrive
    ids += [llm.add_request(p, GREEDY) for p in ps[2:]]
    text, tokens, final = collect(llm, ids, early)
    for i, rid in enumerate(ids):
        assert tokens[rid] == alone[i] == final[rid].outputs[0].token_ids
        assert text[rid] == final[rid].outputs[0].text
        assert final[rid].outputs[0].finish_reason == "length"
    assert not llm.has_unfinished() and llm.step() == []
    assert_pool_empty(llm)


def test_stream_equals_generate():
    llm = make_llm()
    p = prompts(1, seed=12)[0]
    params = ferrum.SamplingParams(max_tokens=30, temperature=0)
    whole = llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].text
    assert "".join(llm.stream(p, params)) == whole
    # two interleaved streams each get their own text
    a, b = llm.stream(p, params), llm.stream(prompts(1, seed=13)[0], params)
    got_a, got_b = "", ""
    for piece_a, piece_b in zip(a, b):
        got_a, got_b = got_a + piece_a, got_b + piece_b
    got_a += "".join(a)
    got_b += "".join(b)
    assert got_a == whole
    assert got_b == llm.generate(prompt_token_ids=[prompts(1, seed=13)[0]], sampling_params=params)[0].outputs[0].text
    assert_pool_empty(llm)


def test_abort_mid_prefill_and_mid_decode_frees_blocks():
    llm = make_llm(max_num_batched_tokens=16)
    long_prompt = prompts(1, seed=21)[0] * 4  # several 16-token chunks
    rid = llm.add_request(long_prompt, GREEDY)
    llm.step()
    st = llm.stats()
    assert st["running"] == 1 and st["kv_blocks_used"] > 0  # mid-prefill
    llm.abort(rid)
    assert_pool_empty(llm)
    rid = llm.add_request(prompts(1, seed=22)[0], GREEDY)
    produced = []
    while len(produced) < 3:
        produced += [t for d in llm.step() for c in d.outputs for t in c.token_ids]
    assert llm.stats()["kv_blocks_used"] > 0  # decoding
    llm.abort(rid)
    llm.abort(rid)  # twice is harmless
    llm.abort("no such request")
    assert_pool_empty(llm)
    ends = llm.step()  # (the first one reported its end during the loop above)
    assert [(d.request_id, d.output.outputs[0].finish_reason) for d in ends] == [(rid, "abort")]
    assert llm.step() == [] and not llm.has_unfinished()


def test_aborted_request_reports_abort_and_the_engine_carries_on():
    llm = make_llm()
    params = ferrum.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    rid = llm.add_request(prompts(1, seed=30)[0], params)
    llm.step()
    llm.abort(rid)  # its last delta (finish_reason "abort") goes to step()
    (d,) = llm.step()
    assert d.finished and d.output.outputs[0].finish_reason == "abort"
    outs = llm.generate(prompt_token_ids=prompts(2, seed=31), sampling_params=params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20]
    assert_pool_empty(llm)


def test_stats_report_the_engine():
    llm = make_llm(max_num_seqs=4)
    ps = prompts(8, seed=40)
    for p in ps:
        llm.add_request(p, GREEDY)
    llm.step()
    st = llm.stats()
    assert st["running"] == 4 and st["waiting"] == 4  # max_num_seqs holds the rest back
    assert st["kv_blocks_used"] > 0 and st["kv_blocks_used"] + st["kv_blocks_free"] == st["kv_blocks_total"]
    while llm.has_unfinished():
        llm.step()
    st = llm.stats()
    assert st["generated_tokens"] == 8 * GREEDY.max_tokens
    assert st["generation_tokens_per_s"] > 0 and st["busy_seconds"] > 0
    assert 0 <= st["prefix_cache_hit_rate"] <= 1
    assert_pool_empty(llm)


def test_kv_pool_sized_by_memory_fraction():
    small = make_llm(kv_cache_memory_fraction=0.0001)
    large = make_llm(kv_cache_memory_fraction=0.0002)
    a, b = small.stats()["kv_blocks_total"], large.stats()["kv_blocks_total"]
    assert a >= 512 // 16 and abs(b - 2 * a) <= 0.1 * b  # (never below one max_model_len sequence)


class _StepSpy:
    """Stands in for the C++ engine of an LLM and counts the steps whose rows belong to both
    a score and a generation."""

    def __init__(self, engine):
        self.engine, self.core, self.shared_steps = engine, engine.core, 0

    def __getattr__(self, name):
        return getattr(self.core, name)

    def step(self):
        scores, generations = set(self.engine._scores), set(self.engine._by_seq)
        out = self.core.step()
        seqs = {int(s) for s in out["seqs"]}
        self.shared_steps += bool(seqs & scores) and bool(seqs & generations)
        return out


def test_scores_and_generations_sharing_steps_compute_as_they_would_alone(smollm2_path):
    """A score computes with f32 activations and a generation with its own (8-bit on this Q4_1
    model, which moves the last logits by ~0.5), because of what each is, not of what shares
    its steps: both give what they give alone."""
    llm = ferrum.LLM(smollm2_path, num_threads=2, max_num_batched_tokens=64)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    params = ferrum.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    score_alone = llm.score(ids)
    generated_alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    spy = llm.engine.core = _StepSpy(llm.engine)
    rids = [llm.add_request(p, params) for p in prompts]
    llm.step()  # the prompts are in: the score's chunks share steps with their decodes
    score_shared = llm.score(ids)
    done = {}
    while llm.has_unfinished():
        done.update({d.request_id: d.output for d in llm.step() if d.finished})
    assert spy.shared_steps >= 2
    np.testing.assert_allclose(score_shared, score_alone, rtol=0, atol=1e-5)
    assert [done[r].outputs[0].token_ids for r in rids] == generated_alone
    assert_pool_empty(llm)


def test_one_llm_called_from_several_threads():
    """generate, stream and score from four threads at once on one LLM, thirteen times over:
    calls interleave on the one engine, none hangs, each gets what it gets alone."""
    import threading
    llm = make_llm()
    ps = prompts(6, seed=11)
    want = greedy_tokens(llm, ps)
    want_scores = llm.score(ps[0])
    want_stream = "".join(llm.stream(ps[1], GREEDY))
    for _ in range(13):
        got, errors = {}, []

        def run(name, fn):
            try:
                got[name] = fn()
            except BaseException as e:  # reported below: a thread's exception must fail the test
                errors.append(e)

        jobs = {"a": lambda: greedy_tokens(llm, ps[:3]), "b": lambda: greedy_tokens(llm, ps[3:]),
                "score": lambda: llm.score(ps[0]), "stream": lambda: "".join(llm.stream(ps[1], GREEDY))}
        threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a call hung"
        assert not errors, errors
        assert got["a"] + got["b"] == want and got["stream"] == want_stream
        np.testing.assert_allclose(got["score"], want_scores, rtol=0, atol=2e-5)
    assert_pool_empty(llm)


def test_prompt_logprobs_match_teacher_forced_scores(device):
    """SamplingParams(prompt_logprobs=k) on an f32 model: each prompt token's logprob equals
    token_logprobs', chunked over steps or not, and asking for them changes no output."""
    ids = prompts(1, seed=12)[0]
    want = make_llm(device).token_logprobs(ids, start=1)
    params = ferrum.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=3, n=2, ignore_eos=True)
    for budget in (512, 7):
        llm = make_llm(device, max_num_batched_tokens=budget)
        out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
        np.testing.assert_allclose(got, want.logprobs, rtol=0, atol=2e-5)
        assert all(3 <= len(entry) <= 4 for entry in out.prompt_logprobs[1:])
        plain = greedy_tokens(llm, [ids], ferrum.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert [o.token_ids for o in out.outputs] == [plain, plain]
        assert_pool_empty(llm)
