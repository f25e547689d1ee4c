"""AsyncLLM: the engine driven by its own thread under asyncio. Requests added while others run
produce what LLM.generate produces; leaving a stream early, abort() and shutdown() free every
KV block; errors reach the caller and the engine carries on."""
import asyncio
import time

import numpy as np
import pytest

import ferrum
from conftest import STORIES_FORMATS
from ferrum.async_llm import AsyncLLM
from ferrum.scoring import LogprobCollector

GREEDY = ferrum.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def slowly(history, logits):
    time.sleep(0.005)  # a step of a request that must still run a while later
    return logits


SLOW = ferrum.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, logits_processors=[slowly])


def make_llm(**kw):
    return ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=256, kv_dtype="f32", **kw)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, 512, rng.integers(1, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def expected():
    """Greedy tokens and text of each prompt, from LLM.generate."""
    outs = make_llm().generate(prompt_token_ids=prompts(12), sampling_params=GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def assert_pool_empty(engine: AsyncLLM):
    st = engine.llm.stats()
    assert st["kv_blocks_used"] == 0 and st["sequences"] == 0 and st["running"] == 0 and st["waiting"] == 0


async def collect(engine, prompt, params=GREEDY, **kw):
    tokens, text, last = [], "", None
    async for delta in engine.generate(prompt, params, **kw):
        tokens += delta.outputs[0].token_ids if delta.outputs else []
        text += delta.text(0)
        last = delta
    assert last.finished and last.output.outputs[0].token_ids == tokens
    return tokens, text, last.output.outputs[0].finish_reason


def test_requests_joining_at_different_times_equal_generate(expected):
    async def main():
        async with AsyncLLM(make_llm()) as engine:
            async def late(i, p):
                await asyncio.sleep(0.01 * i)  # arrive while the earlier ones run
                return await collect(engine, p)
            results = await asyncio.gather(*[late(i, p) for i, p in enumerate(prompts(12))])
            assert [(t, s) for t, s, _ in results] == expected
            assert all(reason == "length" for _, _, reason in results)
            await asyncio.sleep(0)
            assert_pool_empty(engine)
            assert engine.stats()["waiting_requests"] == 0
    asyncio.run(main())


def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(expected):
    async def main():
        async with AsyncLLM(make_llm()) as engine:
            async def leave_after(p, deltas):
                seen = 0
                async for _ in engine.generate(p, SLOW):
                    seen += 1
                    if seen == deltas:
                        break
            async def cancelled(p):
                task = asyncio.ensure_future(collect(engine, p, SLOW))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            ps = prompts(12)
            results = await asyncio.gather(leave_after(ps[0], 1), leave_after(ps[1], 5), cancelled(ps[2]),
                                           *[collect(engine, p) for p in ps[3:]])
            assert [(t, s) for t, s, _ in results[3:]] == expected[3:]
            await wait_idle(engine)
            assert_pool_empty(engine)
    asyncio.run(main())


async def wait_idle(engine, timeout=20.0):
    """Until the engine thread has handled every abort and has nothing left to run."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.llm.has_unfinished() or engine.stats()["running"]:
        assert asyncio.get_running_loop().time() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.02)


def test_a_consumer_that_falls_behind_gets_the_waiting_deltas_merged(expected):
    """Deltas that wait while their consumer is busy arrive as one: fewer deltas than steps,
    each completion's tokens, text and logprobs in order, as the finished output holds them."""
    sampled = ferrum.SamplingParams(max_tokens=24, temperature=0.8, seed=7, n=2, logprobs=2, ignore_eos=True)

    async def main():
        async with AsyncLLM(make_llm()) as engine:
            for params, prompt in ((GREEDY, prompts(1)[0]), (sampled, prompts(2)[1])):
                got = {i: ([], "", []) for i in range(params.n)}
                deltas = 0
                async for delta in engine.generate(prompt, params):
                    deltas += 1
                    for d in delta.outputs:
                        tokens, text, logprobs = got[d.index]
                        got[d.index] = (tokens + d.token_ids, text + d.text, logprobs + (d.logprobs or []))
                    await asyncio.sleep(0.03)  # steps run meanwhile
                assert delta.finished and deltas < params.max_tokens
                for c in delta.output.outputs:
                    assert got[c.index][:2] == (c.token_ids, c.text)
                    if params.logprobs:
                        assert got[c.index][2] == c.logprobs and len(c.logprobs) == params.max_tokens
                if params is GREEDY:
                    assert got[0][:2] == expected[0]
            assert_pool_empty(engine)
    asyncio.run(main())


def test_abort_ends_the_stream_with_abort_and_others_go_on(expected):
    async def main():
        async with AsyncLLM(make_llm()) as engine:
            victim = asyncio.ensure_future(collect(engine, prompts(1)[0], SLOW, request_id="victim"))
            await asyncio.sleep(0.05)
            await engine.abort("victim")
            await engine.abort("no-such-request")  # no-op
            tokens, _, reason = await victim
            assert reason == "abort" and len(tokens) < 200
            assert await collect(engine, prompts(12)[4]) == (*expected[4], "length")
            await wait_idle(engine)
            assert_pool_empty(engine)
    asyncio.run(main())


def test_bad_requests_raise_before_the_first_delta_and_the_engine_carries_on(expected):
    async def main():
        async with AsyncLLM(make_llm()) as engine:
            with pytest.raises(ValueError):
                await collect(engine, [1] + [5] * 400)  # longer than max_model_len
            with pytest.raises(ValueError):
                await collect(engine, [1, 10 ** 6])  # not in the vocabulary
            running = asyncio.ensure_future(collect(engine, prompts(1)[0], request_id="same"))
            await asyncio.sleep(0)
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, prompts(1)[0], request_id="same")
            assert (await running)[:2] == expected[0]

            def broken(history, logits):
                raise ZeroDivisionError("a logits processor failed")
            bystander = asyncio.ensure_future(collect(engine, prompts(12)[5], SLOW))
            await asyncio.sleep(0.05)
            with pytest.raises(ZeroDivisionError):
                await collect(engine, prompts(1)[0], ferrum.SamplingParams(logits_processors=[broken]))
            with pytest.raises(ZeroDivisionError):  # every request of the failed step fails
                await bystander
            assert await collect(engine, prompts(12)[6]) == (*expected[6], "length")
            assert_pool_empty(engine)
    asyncio.run(main())


def test_score_equals_token_logprobs():
    reference = make_llm()
    seqs = prompts(4, seed=3)
    want = reference.token_logprobs(seqs, start=1)

    async def main():
        async with AsyncLLM(make_llm()) as engine:
            collectors = [LogprobCollector(s, 1) for s in seqs]
            background = asyncio.ensure_future(collect(engine, prompts(1)[0]))  # shares the forwards
            await asyncio.gather(*[engine.score(s[:-1], c) for s, c in zip(seqs, collectors)])
            await background
            with pytest.raises(ValueError):
                await engine.score([1] + [5] * 400, LogprobCollector([1] * 402, 1))
            assert_pool_empty(engine)
            return [c.result() for c in collectors]
    got = asyncio.run(main())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        np.testing.assert_array_equal(g.greedy, w.greedy)


def test_shutdown_aborts_what_is_in_flight_and_refuses_more():
    async def main():
        engine = AsyncLLM(make_llm())
        streaming = asyncio.ensure_future(collect(engine, prompts(1)[0], SLOW))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown)
        tokens, _, reason = await streaming
        assert reason == "abort" and len(tokens) < 200
        with pytest.raises(RuntimeError, match="shut down"):
            await collect(engine, prompts(1)[0])
        assert_pool_empty(engine)
        engine.shutdown()  # idempotent
    asyncio.run(main())


def test_wraps_only_an_llm():
    with pytest.raises(TypeError):
        AsyncLLM("model.gguf")
