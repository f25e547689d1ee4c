"""POST /v1/chat/completions: the messages through the model's chat template (with ``tools``
when given), ``response_format`` / ``structured_outputs`` constraints, logprobs, streaming."""
from __future__ import annotations

import jinja2
from fastapi import APIRouter, Request

from .errors import APIError
from .protocol import ChatCompletionRequest
from .serving import Serving, reply, stream_chunks, usage
from .streaming import Chunks

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model)
    try:
        messages = [m.for_template() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools and body.tool_choice != "none":
            kwargs["tools"] = body.tools
        prompt = serving.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
        params = body.sampling_params(body.completion_limit, body.logprobs_count, serving.vocab_size)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise APIError(400, f"{e}") from None
    prompt_ids = serving.prompt_ids(prompt)
    serving.check_length(prompt_ids, body.completion_limit)
    serving.check_room()
    return await reply(request, "chatcmpl", serving.model_name, body.stream,
                       lambda header: _stream(serving, body, prompt_ids, params, header),
                       lambda header: _complete(serving, body, prompt_ids, params, header))


async def _complete(serving: Serving, body: ChatCompletionRequest, prompt_ids, params, header: dict) -> dict:
    output = None
    async for delta in serving.generate(prompt_ids, params):
        output = delta.output
    choices = []
    for c in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = {"content": serving.chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)}
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "length_limit": c.length_limit})
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {**header, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), completion_tokens)}


async def _stream(serving: Serving, body: ChatCompletionRequest, prompt_ids, params, header: dict):
    event = Chunks(header, "chat.completion.chunk", body.include_usage)
    yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)])

    def choice(_, d):
        logprobs = None
        if body.logprobs:
            logprobs = {"content": serving.chat_logprobs(d.token_ids, d.logprobs or [], body.top_logprobs or 0)}
        return {"index": d.index, "delta": {"content": d.text} if d.text else {}, "logprobs": logprobs,
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                "length_limit": d.length_limit}
    async for chunk in stream_chunks(event, [serving.generate(prompt_ids, params)], choice, len(prompt_ids)):
        yield chunk
