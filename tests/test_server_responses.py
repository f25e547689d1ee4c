"""/v1/responses through the `openai` client: text and message-list input, instructions, tools
and function-call outputs, previous_response_id (kept for a bounded number), streamed events
assembling to the non-streamed response, and the 400s (OpenAI's Agents SDK on its default, Responses
model: test_server_tools.py). A real server on 127.0.0.1, a generated tiny Qwen3-shape model with the real
Qwen3 template; the model's part scripted where a test needs a given reply."""
import json

import openai
import pytest
import requests

import ferrum
from server_harness import pool_is_empty, running_server, wait_until
from test_server_tools import NO_THINKING, WEATHER, scripted, tokens

MODEL = "qwen3-tiny"
STORED = 3
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool shape
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REASONING = {"effort": "none"}  # Qwen3's template: no thinking


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    llm = ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=512)
    with running_server(llm, MODEL, max_stored_responses=STORED) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=120, max_retries=0)


def end(engine):
    return [min(engine.tokenizer.eos_token_ids)]


def streamed(client, **kw):
    """The events' types, the text and call arguments their deltas assemble, the final response."""
    kinds, text, args, final = [], "", {}, None
    for e in client.responses.create(stream=True, **kw):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
        elif e.type in ("response.completed", "response.incomplete"):
            final = e.response
    return kinds, text, args, final


def same_output(a, b):
    """Two responses' output items equal but for their ids."""
    def strip(items):
        return [{k: v for k, v in i.model_dump().items() if k not in ("id", "call_id")} for i in items]
    assert strip(a.output) == strip(b.output)
    assert a.output_text == b.output_text and a.status == b.status and a.usage == b.usage


def test_text_input_streamed_and_not(server, client):
    kw = dict(model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0, reasoning=REASONING)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.output[0].type == "message"
    kinds, text, _, final = streamed(client, **kw)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert text == whole.output_text
    same_output(final, whole)
    chat = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0,
        extra_body=NO_THINKING)
    assert chat.choices[0].message.content == whole.output_text  # the same prompt as chat's


def test_instructions_and_message_lists_go_through_the_template(server, client):
    url, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}]
    want = requests.post(f"{url}/tokenize", json={"messages": messages, **NO_THINKING}, timeout=30).json()["count"]
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}]
    got = client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=2,
                                  reasoning=REASONING)
    assert got.usage.input_tokens == want
    developer = client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."}] + items,
                                        max_output_tokens=2, reasoning=REASONING)
    assert developer.usage.input_tokens == want


def test_function_calls_outputs_and_previous_response_id(server, client):
    _, engine = server
    prompts = []

    def script(prompt):
        prompts.append(prompt)
        return tokens(engine, "Sunny in Paris." if "<tool_response>" in prompt else CALL) + end(engine)
    with scripted(engine, script):
        kw = dict(model=MODEL, input="Weather in Paris?", tools=[FUNCTION], reasoning=REASONING, max_output_tokens=60)
        first = client.responses.create(**kw)
        kinds, _, args, final = streamed(client, **kw)
        same_output(final, first)
        call = first.output[0]
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
        assert list(args.values()) == [call.arguments] and "response.function_call_arguments.done" in kinds
        second = client.responses.create(
            model=MODEL, previous_response_id=first.id, tools=[FUNCTION], reasoning=REASONING, max_output_tokens=60,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
        assert second.output_text == "Sunny in Paris." and second.previous_response_id == first.id
        # the history: the question, the call, its output
        assert "Weather in Paris?" in prompts[-1] and '"city": "Paris"' in prompts[-1]
        assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompts[-1]
        # the same conversation given whole
        third = client.responses.create(model=MODEL, tools=[FUNCTION], reasoning=REASONING, max_output_tokens=60, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
        assert prompts[-1] == prompts[-2] and third.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == "Sunny in Paris."


def test_only_the_last_responses_are_kept(server, client):
    ids = [client.responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=1, reasoning=REASONING).id
           for i in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="again", previous_response_id=ids[0], max_output_tokens=1)
    assert client.responses.create(model=MODEL, input="again", previous_response_id=ids[-1], max_output_tokens=1)
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    wait_until(lambda: pool_is_empty(server[1]), what="the KV pool to empty")


@pytest.mark.parametrize("body,status,words", [
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, "text"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "item_reference"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "reasoning": {"summary": "detailed"}}, 400, "summary"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "resp_nope"),
    ({"input": []}, 400, "empty"),
    ({"input": "x", "tool_choice": "required"}, 400, "tools"),
])
def test_bad_responses_requests(server, body, status, words):
    r = requests.post(f"{server[0]}/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **body}, timeout=30)
    assert r.status_code == status, r.text
    assert words in r.text
