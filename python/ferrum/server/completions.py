"""POST /v1/completions: prompts as text, texts or token ids; ``echo`` with prompt logprobs
(scored with f32 activations, as ``ferrum.eval`` scores, so lm-evaluation-harness's
log-likelihoods equal ``ferrum.eval.loglikelihood``'s); streaming."""
from __future__ import annotations

import asyncio
from typing import List, Union

from fastapi import APIRouter, Request

from ..outputs import CompletionOutput, RequestOutput
from .errors import APIError
from .protocol import CompletionRequest
from .serving import Serving, reply, stream_chunks, usage
from .streaming import Chunks

router = APIRouter()


class _Prompt:
    """One prompt of a request: its text (as echoed) and token ids."""

    def __init__(self, serving: Serving, prompt: Union[str, List[int]]):
        self.ids = serving.prompt_ids(prompt)
        self.text = prompt if isinstance(prompt, str) else serving.tokenizer.decode(self.ids, skip_special_tokens=False)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model, body.lora_scale)
    try:
        prompts = [_Prompt(serving, p) for p in body.prompts()]
        params = None if body.max_tokens == 0 else body.sampling_params(body.max_tokens, body.logprobs,
                                                                         serving.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    for p in prompts:
        serving.check_length(p.ids, body.max_tokens)
    serving.check_room()
    return await reply(request, "cmpl", serving.model_name, body.stream,
                       lambda header: _stream(serving, body, prompts, params, header),
                       lambda header: _complete(serving, body, prompts, params, header))


async def _complete(serving: Serving, body: CompletionRequest, prompts: List[_Prompt], params, header: dict) -> dict:
    lora = serving.lora_for(body.model, body.lora_scale)

    async def one(p: _Prompt):
        """(the request's output or None without generation, the prompt's logprobs or None)"""
        jobs = []
        if params is not None:
            jobs.append(_final_output(serving, p.ids, params, lora))
        if body.echo and body.logprobs is not None:
            jobs.append(serving.prompt_logprobs(p.ids, body.logprobs, lora))
        results = await _all(jobs)
        output = results.pop(0) if params is not None else None
        return output, (results[0] if results else None)

    results = await _all([one(p) for p in prompts])
    n = body.n
    choices, completion_tokens = [], 0
    for i, (p, (output, prompt_lps)) in enumerate(zip(prompts, results)):
        outs = output.outputs if output is not None else [CompletionOutput(k, "", [], None, [], "length")
                                                        for k in range(n)]
        for c in outs:
            completion_tokens += len(c.token_ids)
            text, token_ids, steps = c.text, c.token_ids, c.logprobs or []
            if body.echo:
                text = p.text + text
                token_ids, steps = p.ids + token_ids, (prompt_lps or [None] * len(p.ids)) + steps
            logprobs = None if body.logprobs is None else serving.completion_logprobs(token_ids, steps)
            choices.append({"index": i * n + c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "length_limit": c.length_limit})
    prompt_tokens = sum(len(p.ids) for p in prompts)
    return {**header, "object": "text_completion", "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


async def _final_output(serving: Serving, prompt_ids: List[int], params, lora=None) -> RequestOutput:
    output = None
    async for delta in serving.generate(prompt_ids, params, lora):
        output = delta.output  # the last delta's: the whole output
    return output


async def _stream(serving: Serving, body: CompletionRequest, prompts: List[_Prompt], params, header: dict):
    n = body.n
    lora = serving.lora_for(body.model, body.lora_scale)
    event = Chunks(header, "text_completion", body.include_usage)
    if body.echo:
        for i, p in enumerate(prompts):
            lps = None
            if body.logprobs is not None:
                lps = serving.completion_logprobs(p.ids, await serving.prompt_logprobs(p.ids, body.logprobs, lora))
            yield event([{"index": i * n + k, "text": p.text, "logprobs": lps, "finish_reason": None}
                         for k in range(n)])

    def choice(i, d):
        logprobs = None
        if body.logprobs is not None:
            logprobs = serving.completion_logprobs(d.token_ids, d.logprobs or [])
        return {"index": i * n + d.index, "text": d.text, "logprobs": logprobs,
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                "length_limit": d.length_limit}
    streams = [serving.generate(p.ids, params, lora) for p in prompts]
    async for chunk in stream_chunks(event, streams, choice, sum(len(p.ids) for p in prompts)):
        yield chunk


async def _all(coros) -> list:
    """asyncio.gather that cancels the others when one fails (or the caller leaves)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
