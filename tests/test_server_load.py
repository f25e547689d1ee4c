"""Load on a real server: 64 concurrent streaming clients (the async `openai` client) with random
lengths, a fifth of them disconnecting mid-stream. Every other request streams exactly what
LLM.generate produces for it, and afterwards every KV block is free."""
import asyncio

import numpy as np
import openai
import requests

import ferrum
from conftest import STORIES_FORMATS
from server_harness import pool_is_empty, running_server, wait_until

CLIENTS = 64
LEAVING = 0.2


def make_llm():
    return ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=256, kv_dtype="f32")


def test_64_streaming_clients_with_disconnects():
    rng = np.random.default_rng(29)
    words = ["the", "cat", "sat", "on", "a", "mat", "Lily", "saw", "big", "red", "ball", "and", "ran", "home"]
    prompts = [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(CLIENTS)]
    leaves_after = [int(rng.integers(1, 4)) if rng.random() < LEAVING else None for _ in range(CLIENTS)]
    # Those that leave would run long: they leave mid-generation.
    lengths = [int(rng.integers(4, 64)) if leave is None else 150 for leave in leaves_after]
    assert sum(x is not None for x in leaves_after) >= CLIENTS // 10

    reference = make_llm().generate(prompts, [ferrum.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                              for n in lengths])

    with running_server(make_llm(), "stories") as (url, engine):
        async def one(client, prompt, length, leave_after):
            stream = await client.completions.create(
                model="stories", prompt=prompt, max_tokens=length, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, reason, usage, chunks = "", None, None, 0
            async for chunk in stream:
                chunks += 1
                if leave_after is not None and chunks == leave_after:
                    await stream.close()  # the client goes away mid-stream
                    return None
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.text
                    reason = c.finish_reason or reason
            return text, reason, usage.completion_tokens

        async def main():
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0) as client:
                return await asyncio.gather(*[one(client, p, n, leave)
                                              for p, n, leave in zip(prompts, lengths, leaves_after)])

        results = asyncio.run(main())
        for result, want, n, leave in zip(results, reference, lengths, leaves_after):
            if leave is not None:
                assert result is None
                continue
            assert result == (want.outputs[0].text, "length", n)
        wait_until(lambda: pool_is_empty(engine), timeout_s=60, what="every KV block free")
        st = engine.stats()
        assert st["kv_blocks_used"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        assert "ferrum:kv_cache_usage_perc 0.0" in metrics
        assert f'ferrum:request_success_total{{finished_reason="abort",model_name="stories"}} ' \
               f'{float(sum(x is not None for x in leaves_after))}' in metrics
