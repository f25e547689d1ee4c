"""POST /v1/responses (OpenAI's Responses API) over the chat pipeline: ``input`` (text or items:
messages, function calls and their outputs) and ``instructions`` become chat messages, ``tools``
and ``tool_choice`` the chat tools, and the reply's reasoning, text and calls the response's
output items; ``stream`` sends the Responses events. Responses are kept in memory (the last
``max_stored``, unless ``store: false``) so that ``previous_response_id`` continues one and
``GET /v1/responses/{id}`` returns it."""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .chat import prepare
from .errors import APIError
from .protocol import ChatCompletionRequest, ResponsesRequest
from .reply import Message, ReplySplitter
from .serving import Serving, unless_disconnected
from .streaming import sse_typed_response
from .tool_calls import call_id

router = APIRouter()


class ResponseStore:
    """The last `capacity` responses: each one's body, and its conversation as chat messages."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: "OrderedDict[str, tuple]" = OrderedDict()

    def put(self, response: dict, messages: List[dict]) -> None:
        self._items[response["id"]] = (response, messages)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple:
        if response_id not in self._items:
            raise APIError(404, f"Response with id '{response_id}' not found (responses are kept in memory, "
                                f"the last {self.capacity}).", "previous_response_id")
        return self._items[response_id]


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be text or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: only text content parts are supported, got {part!r}")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: Any) -> List[dict]:
    """Responses input as chat messages: function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: List[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}: role must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # earlier reasoning: the chat templates leave it out of the history
        else:
            raise ValueError(f"{where}: input items of type {kind!r} are not supported")
    return messages


def _chat_tools(tools: Optional[List[dict]]) -> Optional[List[dict]]:
    if tools is None:
        return None
    out = []
    for t in tools:
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ValueError(f"only function tools ({{'type': 'function', 'name': ...}}) are supported, got {t!r}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if set(text or {}) - {"format", "verbosity"} or (text or {}).get("verbosity") not in (None, "medium"):
        raise ValueError(f"text: only format is supported, got {text!r}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}}
    raise ValueError(f"text.format must be text, json_object or json_schema, got {fmt!r}")


def _thinking(reasoning: Optional[dict]) -> Dict[str, Any]:
    """reasoning.effort "none" turns a template's thinking off; any other effort leaves it on."""
    if not reasoning:
        return {}
    if set(reasoning) - {"effort", "summary"} or reasoning.get("summary") not in (None, "auto"):
        raise ValueError(f"reasoning: only effort (and summary 'auto') are supported, got {reasoning!r}")
    return {"enable_thinking": False} if reasoning.get("effort") in ("none", "minimal") else {}


def chat_request(body: ResponsesRequest, history: List[dict]) -> ChatCompletionRequest:
    """The chat completion request a Responses request runs as; ValueError for what it cannot say."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    if not messages:
        raise ValueError("input is empty")
    fields = dict(model=body.model, messages=messages, tools=_chat_tools(body.tools),
                  tool_choice=_chat_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
                  max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                  seed=body.seed, response_format=_response_format(body.text),
                  chat_template_kwargs=_thinking(body.reasoning) or None)
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    serving: Serving = request.app.state.serving
    store: ResponseStore = request.app.state.responses
    serving.check_model(body.model, body.lora_scale)
    history = list(store.get(body.previous_response_id)[1]) if body.previous_response_id else []
    try:
        history += chat_messages(body.input)
        chat = chat_request(body, history)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    prompt_ids, params, split = prepare(serving, chat)
    serving.check_room()
    run = _Run(serving, body, split, prompt_ids, history)
    if body.stream:
        return sse_typed_response(request, run.events(params, store))
    result = await unless_disconnected(request, run.whole(params, store))
    return Response(status_code=204) if result is None else result


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return request.app.state.responses.get(response_id)[0]


class _Run:
    """One response: its ids, the reply's items, and the response body around them."""

    def __init__(self, serving: Serving, body: ResponsesRequest, split: ReplySplitter, prompt_ids, history):
        self.serving, self.body, self.split, self.prompt_ids, self.history = serving, body, split, prompt_ids, history
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        self.output_tokens = 0

    def response(self, status: str, output: List[dict], reason: Optional[str] = None) -> dict:
        b = self.body
        done = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if done else None,
                "model": self.serving.model_name, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": b.instructions, "metadata": b.metadata or {}, "tools": b.tools or [],
                "tool_choice": b.tool_choice or "auto", "parallel_tool_calls": b.parallel_tool_calls,
                "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "previous_response_id": b.previous_response_id, "store": b.store, "text": b.text or {"format": {"type": "text"}},
                "truncation": b.truncation, "user": b.user,
                "usage": {"input_tokens": len(self.prompt_ids), "output_tokens": self.output_tokens,
                          "total_tokens": len(self.prompt_ids) + self.output_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}} if done else None}

    def reasoning_item(self, text: str) -> dict:
        return {"type": "reasoning", "id": self.ids["reasoning"], "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    def message_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.ids["message"], "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def items(self, m: Message, calls: List[dict]) -> List[dict]:
        out = [self.reasoning_item(m.reasoning)] if m.reasoning else []
        if m.content or not calls:
            out.append(self.message_item(m.content or ""))
        return out + calls

    def calls(self, m: Message) -> List[dict]:
        return [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id(self.split.tools),
                 "name": c.name, "arguments": c.arguments, "status": "completed"} for c in m.tool_calls]

    def finish(self, store: ResponseStore, m: Message, calls: List[dict], reason: str) -> dict:
        status = "incomplete" if reason == "length" and not (calls and m.calls_complete) else "completed"
        response = self.response(status, self.items(m, calls), reason)
        if self.body.store:
            reply = {"role": "assistant", "content": m.content or ""}
            if calls:
                reply["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            store.put(response, self.history + [reply])
        return response

    async def whole(self, params, store: ResponseStore) -> dict:
        output = None
        lora = self.serving.lora_for(self.body.model, self.body.lora_scale)
        async for delta in self.serving.generate(self.prompt_ids, params, lora):
            output = delta.output
        c = output.outputs[0]
        self.output_tokens = len(c.token_ids)
        m = self.split.whole(c.text)
        return self.finish(store, m, self.calls(m), c.finish_reason)

    async def events(self, params, store: ResponseStore):
        """The Responses stream: created, in_progress; each output item added, its deltas, done;
        then completed (or incomplete)."""
        seq = iter(range(1 << 62))

        def event(kind: str, **fields) -> dict:
            return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": next(seq), **fields})}
        yield event("response.created", response=self.response("in_progress", []))
        yield event("response.in_progress", response=self.response("in_progress", []))
        stream = self.split.stream()
        opened: List[str] = []  # "reasoning", then "message"
        texts = {"reasoning": "", "message": ""}

        def open_item(kind: str):
            index = len(opened)
            opened.append(kind)
            item = self.reasoning_item("") if kind == "reasoning" else self.message_item("", "in_progress")
            item["content"] = []
            yield event("response.output_item.added", output_index=index, item=item)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=self.ids[kind], output_index=index, content_index=0,
                        part=part)

        def close_item(kind: str):
            index, text = opened.index(kind), texts[kind]
            if kind == "reasoning":
                yield event("response.reasoning_text.done", item_id=self.ids[kind], output_index=index,
                            content_index=0, text=text)
                part, item = {"type": "reasoning_text", "text": text}, self.reasoning_item(text)
            else:
                yield event("response.output_text.done", item_id=self.ids[kind], output_index=index,
                            content_index=0, text=text, logprobs=[])
                part, item = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}, self.message_item(text)
            yield event("response.content_part.done", item_id=self.ids[kind], output_index=index, content_index=0,
                        part=part)
            yield event("response.output_item.done", output_index=index, item=item)

        def send(deltas: List[dict]):
            for d in deltas:
                kind = "reasoning" if "reasoning" in d else "message"
                piece = d["reasoning"] if kind == "reasoning" else d["content"]
                if kind not in opened:
                    if opened:  # the reasoning is over once text comes
                        yield from close_item(opened[-1])
                    yield from open_item(kind)
                texts[kind] += piece
                yield event(f"response.{kind if kind == 'reasoning' else 'output'}_text.delta", item_id=self.ids[kind],
                            output_index=opened.index(kind), content_index=0, delta=piece,
                            **({} if kind == "reasoning" else {"logprobs": []}))

        reason = None
        lora = self.serving.lora_for(self.body.model, self.body.lora_scale)
        async for delta in self.serving.generate(self.prompt_ids, params, lora):
            d = delta.outputs[0]
            self.output_tokens += len(d.token_ids)
            for e in send(stream.feed(d.text)):
                yield e
            reason = d.finish_reason or reason
        final, m = stream.finish()
        for e in send(final):
            yield e
        calls = self.calls(m)
        if "message" not in opened and (m.content or not calls):  # an empty reply still has its message
            if opened:
                for e in close_item(opened[-1]):
                    yield e
            for e in open_item("message"):
                yield e
        if opened:
            for e in close_item(opened[-1]):
                yield e
        for call in calls:
            index = len(opened)
            opened.append(call["id"])
            yield event("response.output_item.added", output_index=index, item={**call, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                        delta=call["arguments"])
            yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                        arguments=call["arguments"], name=call["name"])
            yield event("response.output_item.done", output_index=index, item=call)
        response = self.finish(store, m, calls, reason)
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)
