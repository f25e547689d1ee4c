"""POST /v1/chat/completions: the messages through the model's chat template (with ``tools``
when given), ``response_format`` / ``structured_outputs`` constraints, tool calls and reasoning
split out of the reply, logprobs, streaming."""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import jinja2
from fastapi import APIRouter, Request

from .chat_tools import plan_tools, splitter, tool_calls_json
from ..sampling import SamplingParams
from .errors import APIError
from .protocol import ChatCompletionRequest
from .reply import Message, ReplySplitter
from .serving import Serving, reply, usage
from .streaming import Chunks

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model, body.lora_scale)
    prompt_ids, params, split = prepare(serving, body)
    serving.check_room()
    return await reply(request, "chatcmpl", serving.model_name, body.stream,
                       lambda header: _stream(serving, body, split, prompt_ids, params, header),
                       lambda header: _complete(serving, body, split, prompt_ids, params, header))


def prepare(serving: Serving, body: ChatCompletionRequest) -> Tuple[List[int], SamplingParams, ReplySplitter]:
    """The request's prompt ids, sampling params (with the tools' grammar) and how its replies
    split; a 400 for what cannot be honoured."""
    try:
        messages = [m.for_template() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        reasoning = serving.reasoning_format
        # The prompt without tools tells where the reply starts relative to a reasoning block.
        state = reasoning.state_after(serving.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs)) if reasoning else "closed"
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, serving.tool_format,
                          serving.tokenizer, reasoning, state)
        if plan.template_tools:
            kwargs["tools"] = plan.template_tools
        prompt = serving.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
        params = body.sampling_params(body.completion_limit, body.logprobs_count, serving.vocab_size)
        if plan.format is not None:
            if params.structured_outputs is not None:
                raise ValueError("tools cannot be combined with response_format or structured_outputs; "
                                 "give tool_choice 'none' for a constrained reply")
            # The call markers may be special tokens: the reply's text keeps them to be parsed.
            params = dataclasses.replace(params, structured_outputs=plan.constraint, skip_special_tokens=False)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise APIError(400, f"{e}") from None
    prompt_ids = serving.prompt_ids(prompt)
    serving.check_length(prompt_ids, body.completion_limit)
    return prompt_ids, params, splitter(plan, reasoning, state == "inside")


def _message(m: Message, split: ReplySplitter) -> dict:
    out = {"role": "assistant", "content": m.content}
    if split.reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = tool_calls_json(m.tool_calls, split.tools)
    return out


def _finish_reason(m: Message, reason):
    return "tool_calls" if m.tool_calls and m.calls_complete and reason in ("stop", "length") else reason


async def _complete(serving: Serving, body: ChatCompletionRequest, split: ReplySplitter, prompt_ids, params,
                    header: dict) -> dict:
    output = None
    async for delta in serving.generate(prompt_ids, params, serving.lora_for(body.model, body.lora_scale)):
        output = delta.output
    choices = []
    for c in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = {"content": serving.chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)}
        m = split.whole(c.text)
        choices.append({"index": c.index, "message": _message(m, split), "logprobs": logprobs,
                        "finish_reason": _finish_reason(m, c.finish_reason), "stop_reason": c.stop_reason,
                        "length_limit": c.length_limit})
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {**header, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), completion_tokens)}


async def _stream(serving: Serving, body: ChatCompletionRequest, split: ReplySplitter, prompt_ids, params,
                  header: dict):
    """OpenAI's chunks: the role first; text and reasoning as they are sure; each tool call's id
    and name, then pieces of its arguments (as they are written when a grammar holds the calls,
    else once the reply has ended); the finish reason last."""
    event = Chunks(header, "chat.completion.chunk", body.include_usage)
    yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)])
    streams = [split.stream() for _ in range(body.n)]
    completion_tokens = 0
    async for delta in serving.generate(prompt_ids, params, serving.lora_for(body.model, body.lora_scale)):
        for d in delta.outputs:
            completion_tokens += len(d.token_ids)
            logprobs = None
            if body.logprobs:
                logprobs = {"content": serving.chat_logprobs(d.token_ids, d.logprobs or [], body.top_logprobs or 0)}
            stream = streams[d.index]
            parts = stream.feed(d.text) + stream.call_deltas()
            reason = None
            if d.finish_reason:
                more, message = stream.finish()
                parts += more + stream.finish_calls(message)
                reason = _finish_reason(message, d.finish_reason)
            if not parts and (logprobs is not None or reason is not None):
                parts = [{}]
            for j, part in enumerate(parts):
                last = j == len(parts) - 1
                yield event([{"index": d.index, "delta": part, "logprobs": logprobs if j == 0 else None,
                              "finish_reason": reason if last else None,
                              "stop_reason": d.stop_reason if last else None,
                              "length_limit": d.length_limit if last else None}])
    if event.include_usage:
        yield event([], usage(len(prompt_ids), completion_tokens))
