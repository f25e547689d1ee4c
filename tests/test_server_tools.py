"""Tool calls through the server with the `openai` client, on a generated Qwen3-shape model with
the real Qwen3 tokenizer and chat template: required and named calls sampled at temperature 1
always parse and match their tool's schema; auto mode's grammar engages at a scripted
`<tool_call>` (and free text stays free); streamed == non-streamed field by field; the history
(assistant calls, tool results) goes through the template as transformers renders it; bad
tool requests get 400s."""
import contextlib
import dataclasses
import json

import jsonschema
import numpy as np
import openai
import pytest
import requests

import ferrum
from conftest import MODELS
from ferrum.structured import MASK_COST
from server_harness import pool_is_empty, running_server, wait_until

QWEN3_TOKENIZER = f"{MODELS}/tokenizers/qwen3-0.6b"
MODEL = "qwen3-tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "number", "minimum": 0, "maximum": 10},
                                                    "exact": {"type": "boolean"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 3.", "Is it raining in Oslo?", "What is 7 plus 1.5?",
             "Weather in Lima, please.", "Sum 10 and 4."]


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    llm = ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=512)
    with running_server(llm, MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=120, max_retries=0)


def ask(text):
    return [{"role": "user", "content": text}]


def check_calls(message, tools, at_most_one=False):
    """Every call names one of `tools` and its arguments parse and match that tool's schema."""
    assert message.tool_calls, message
    assert not at_most_one or len(message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_calls_always_parse_and_match_the_schema(client):
    """Temperature 1, several seeds and questions, n=8 each: 192 sampled calls."""
    named = {"type": "function", "function": {"name": "add"}}
    count = 0
    for choice, tools in (("required", TOOLS), (named, [ADD])):
        for seed, question in enumerate(QUESTIONS[:4] if choice == "required" else QUESTIONS[2:]):
            reply = client.chat.completions.create(
                model=MODEL, messages=ask(question), tools=TOOLS, tool_choice=choice, max_tokens=80,
                temperature=1.0, seed=seed, n=8, extra_body=NO_THINKING)
            for c in reply.choices:
                assert c.finish_reason == "tool_calls"
                check_calls(c.message, tools, at_most_one=choice is named)
                count += len(c.message.tool_calls)
    assert count >= 64


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(QUESTIONS[seed]), tools=TOOLS, tool_choice="required", max_tokens=80,
            temperature=1.0, seed=seed, n=8, parallel_tool_calls=False, extra_body=NO_THINKING)
        for c in reply.choices:
            check_calls(c.message, TOOLS, at_most_one=True)


def forcing(token_ids):
    """A logits processor that makes the completion start with `token_ids`, then leaves it free."""
    def force(output_ids, logits):
        if len(output_ids) < len(token_ids):
            logits[:] = -np.inf
            logits[token_ids[len(output_ids)]] = 0.0
        return logits
    return force


@contextlib.contextmanager
def scripted(engine, token_ids):
    """Every request on `engine` starts with `token_ids` (a list, or a function of the prompt's
    text giving one); the model's own part comes after."""
    original = engine.generate

    def generate(prompt, params=None, request_id=None, **kw):
        script = token_ids(engine.tokenizer.decode(prompt, skip_special_tokens=False)) if callable(token_ids) else token_ids
        return original(prompt, dataclasses.replace(params, logits_processors=[forcing(script)]), request_id, **kw)
    engine.generate = generate
    try:
        yield
    finally:
        del engine.generate


def tokens(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def streamed(client, **kw):
    """The stream's chunks assembled as the openai client's users do: text, reasoning, calls by index."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for t in c.delta.tool_calls or ():
                entry = calls.setdefault(t.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                if t.id:
                    assert entry["id"] is None and not entry["arguments"]  # id and name come first
                    entry["id"] = t.id
                entry["name"] += (t.function.name or "") if t.function else ""
                piece = (t.function.arguments or "") if t.function else ""
                entry["arguments"] += piece
                entry["pieces"] += bool(piece)
            reason = c.finish_reason or reason
    return content, reasoning, [calls[k] for k in sorted(calls)], reason


def same_reply(whole, stream):
    """Streamed == non-streamed, field by field (each call's id is its own)."""
    m = whole.choices[0].message
    content, reasoning, calls, reason = stream
    assert content == (m.content or "")
    assert reasoning == ((m.model_extra or {}).get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(t.function.name, t.function.arguments)
                                                            for t in (m.tool_calls or [])]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls)
    assert reason == whole.choices[0].finish_reason


def test_streamed_calls_assemble_to_the_non_streamed_reply(server, client):
    _, engine = server
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for seed in range(3):
            kw = dict(model=MODEL, messages=ask(QUESTIONS[seed]), tools=TOOLS, tool_choice=choice, max_tokens=80,
                      temperature=1.0, seed=seed, extra_body=NO_THINKING)
            stream = streamed(client, **kw)
            same_reply(client.chat.completions.create(**kw), stream)
            assert max(c["pieces"] for c in stream[2]) > 1  # the arguments stream as they are written
    script = tokens(engine, "Let me check that.\n<tool_call>\n")  # then the model, under the grammar
    with scripted(engine, script):
        for seed in range(3):
            kw = dict(model=MODEL, messages=ask(QUESTIONS[seed]), tools=TOOLS, max_tokens=80, temperature=1.0,
                      seed=seed, extra_body=NO_THINKING)
            whole = client.chat.completions.create(**kw)
            assert whole.choices[0].message.content == "Let me check that."
            check_calls(whole.choices[0].message, TOOLS)
            same_reply(whole, streamed(client, **kw))


def test_auto_engages_the_grammar_at_the_call_and_leaves_text_free(server, client):
    _, engine = server
    # A whole scripted call, parallel calls and the end: parsed as the model wrote it.
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    with scripted(engine, tokens(engine, text) + [min(engine.tokenizer.eos_token_ids)]):
        reply = client.chat.completions.create(model=MODEL, messages=ask("Paris weather and 2+3?"), tools=TOOLS,
                                               max_tokens=80, extra_body=NO_THINKING)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]
    assert len({t.id for t in c.message.tool_calls}) == 2

    # No call started: no mask was computed, and the text is the model's own.
    before = MASK_COST.snapshot()["steps"]
    reply = client.chat.completions.create(model=MODEL, messages=ask("Hello"), tools=TOOLS, max_tokens=24,
                                           temperature=1.0, seed=3, extra_body=NO_THINKING)
    assert "<tool_call>" not in (reply.choices[0].message.content or "")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    assert MASK_COST.snapshot()["steps"] == before

    # A call cut by max_tokens before its name is whole comes back as text, streamed the same.
    with scripted(engine, tokens(engine, "<tool_call>\n")):
        kw = dict(model=MODEL, messages=ask("Weather?"), tools=TOOLS, max_tokens=6, temperature=1.0, seed=0,
                  extra_body=NO_THINKING)
        whole = client.chat.completions.create(**kw)
        assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"
        assert whole.choices[0].message.content.startswith('<tool_call>\n{"name":')
        same_reply(whole, streamed(client, **kw))
    # Cut once the call's name is written: the call begun, its arguments so far, streamed the same.
    script = tokens(engine, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    with scripted(engine, script):
        kw = dict(model=MODEL, messages=ask("Weather?"), tools=TOOLS, max_tokens=len(script) + 1, temperature=1.0,
                  seed=0, extra_body=NO_THINKING)
        whole = client.chat.completions.create(**kw)
        c = whole.choices[0]
        assert c.finish_reason == "length" and c.message.content is None
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        assert c.message.tool_calls[0].function.arguments.startswith("{")
        same_reply(whole, streamed(client, **kw))
    # The marker spelled in other tokens than its own: the grammar cannot follow, the text stays free.
    pieces = [t for piece in ("<", "tool", "_call", ">") for t in tokens(engine, piece)]
    with scripted(engine, pieces + tokens(engine, '\n{"name": 1}\n</tool_call>') + [min(engine.tokenizer.eos_token_ids)]):
        whole = client.chat.completions.create(model=MODEL, messages=ask("Weather?"), tools=TOOLS, max_tokens=40,
                                               extra_body=NO_THINKING)
    assert whole.choices[0].message.tool_calls is None
    assert whole.choices[0].message.content == '<tool_call>\n{"name": 1}\n</tool_call>'
    wait_until(lambda: pool_is_empty(engine), what="the KV pool to empty")


def test_history_with_calls_and_results_renders_as_transformers_does(server, client):
    from transformers import AutoTokenizer
    url, _ = server
    arguments = '{"city": "Paris"}'
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    got = requests.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30).json()["tokens"]
    reference = [dict(m) for m in messages]
    reference[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.loads(arguments)}}]}
    want = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).apply_chat_template(
        reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert got == AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).encode(want, add_special_tokens=False)
    assert "<tool_response>" in want and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in want
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert reply.usage.prompt_tokens == len(got)


BAD = [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, ""),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, "JSON"),
]


@pytest.mark.parametrize("extra,words", BAD)
def test_bad_tool_requests_get_400(server, extra, words):
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **extra}
    r = requests.post(f"{server[0]}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_completes_a_two_step_tool_exchange(server, api):
    """OpenAI's Agents SDK as users run it, on its chat completions model and on its default
    (the Responses API): the agent asks the model, runs the tool the model calls, sends the
    result back, and gets the answer. The model's part is scripted: a call first, an answer once
    the prompt holds the tool's response."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    url, engine = server
    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny, 21 C in {city}"

    end = [min(engine.tokenizer.eos_token_ids)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = "It is sunny and 21 C in Paris."

    def script(prompt):
        assert "get_weather" in prompt  # the SDK sent the tool
        if "<tool_response>\nSunny, 21 C in Paris\n</tool_response>" in prompt:
            return tokens(engine, answer) + end
        return tokens(engine, call) + end

    kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    model = kind(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                                               max_retries=0, timeout=120))
    settings = ModelSettings(max_tokens=80, extra_body=NO_THINKING) if api == "chat" else \
        ModelSettings(max_tokens=80, reasoning={"effort": "none"})
    agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                  model_settings=settings)
    with scripted(engine, script):
        result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert cities == ["Paris"]
    assert result.final_output == answer


def test_reasoning_goes_to_reasoning_content_streamed_as_its_own_deltas(server, client):
    _, engine = server
    end = [min(engine.tokenizer.eos_token_ids)]
    think = "<think>\nThe user wants Paris.\n</think>\n\n"
    cases = [(think + "Paris is sunny.", None, ("The user wants Paris.", "Paris is sunny.", None)),
             (think + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', TOOLS,
              ("The user wants Paris.", None, [("get_weather", '{"city": "Paris"}')]))]
    for text, tools, (reasoning, content, calls) in cases:
        with scripted(engine, tokens(engine, text) + end):
            kw = dict(model=MODEL, messages=ask("Weather in Paris?"), max_tokens=60,
                      **({"tools": tools} if tools else {}))
            whole = client.chat.completions.create(**kw)
            m = whole.choices[0].message
            assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"] == reasoning
            assert m.content == content
            assert calls is None or [(t.function.name, t.function.arguments) for t in m.tool_calls] == calls
            same_reply(whole, streamed(client, **kw))
            deltas = [c.delta for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices]
            assert all(not (d.content and (d.model_extra or {}).get("reasoning_content")) for d in deltas)
            assert sum(bool((d.model_extra or {}).get("reasoning_content")) for d in deltas) >= 1
    # enable_thinking: false: the template closes the block in the prompt; nothing is reasoning.
    with scripted(engine, tokens(engine, "Plain answer.") + end):
        m = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=20,
                                           extra_body=NO_THINKING).choices[0].message
    assert m.content == "Plain answer." and m.model_extra["reasoning_content"] is None
