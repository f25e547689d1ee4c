"""The OpenAI-compatible server, through the official `openai` client and plain HTTP: completions
and chat, streamed deltas joining to the non-streamed text, usage, logprobs, echo, n, seeds,
stops, JSON-schema output, the small endpoints; every bad input gets its 4xx and the server goes
on serving. A real server on 127.0.0.1, SmolLM2-135M-Instruct."""
import json
import re

import jsonschema
import openai
import pytest
import requests

import ferrum
from conftest import STORIES_FORMATS
from server_harness import pool_is_empty, running_server, wait_until

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Once upon a time, a little robot", "def fibonacci(n):"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2_path):
    llm = ferrum.LLM(smollm2_path, num_threads=2, max_model_len=512)
    with running_server(llm, MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=120, max_retries=0)


def chat(text):
    return [{"role": "user", "content": text}]


def test_models_health_tokenize(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    tokens = requests.post(f"{url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = requests.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "Hello world"}
    info = requests.get(f"{url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]


def test_streamed_completions_join_to_the_non_streamed_text(client):
    for prompt in (PROMPTS, PROMPTS[0]):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        texts, reasons, usage = {}, {}, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        assert texts == {c.index: c.text for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}
        assert usage == whole.usage and usage.completion_tokens == 20 * len(whole.choices)


def test_streamed_chat_joins_to_the_non_streamed_message(server, client):
    messages = chat("Write one sentence about the sea.")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, role, reason, usage = "", None, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            role = c.delta.role or role
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert (role, text, reason) == ("assistant", whole.choices[0].message.content, whole.choices[0].finish_reason)
    prompt_tokens = requests.post(f"{server[0]}/tokenize", json={"messages": messages}, timeout=10).json()["count"]
    assert usage == whole.usage and usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == 24 or whole.choices[0].finish_reason == "stop"


def test_usage_and_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    c = out.choices[0]
    prompt_tokens = requests.post(f"{server[0]}/tokenize", json={"prompt": PROMPTS[0]}, timeout=10).json()["count"]
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == len(c.logprobs.tokens) == 8
    assert "".join(c.logprobs.tokens) == c.text
    for token, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert len(top) == 3 and lp <= 0
        assert top[token] == lp == max(top.values())  # greedy: the chosen token is the most likely
    assert c.logprobs.text_offset == [sum(map(len, c.logprobs.tokens[:i])) for i in range(8)]

    reply = client.chat.completions.create(model=MODEL, messages=chat("Hi!"), max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    streamed = [e for chunk in client.chat.completions.create(
                    model=MODEL, messages=chat("Hi!"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                    stream=True) for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_returns_the_prompt_with_its_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, logprobs=1)
    c = out.choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert c.text == PROMPTS[0] + plain.choices[0].text
    n_prompt = out.usage.prompt_tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens[:n_prompt]) == PROMPTS[0] and len(c.logprobs.tokens) == n_prompt + 4
    streamed_text, streamed_tokens, streamed_lps = "", [], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                           logprobs=1, stream=True):
        streamed_text += chunk.choices[0].text
        streamed_tokens += chunk.choices[0].logprobs.tokens
        streamed_lps += chunk.choices[0].logprobs.token_logprobs
    assert (streamed_text, streamed_tokens, streamed_lps) == (c.text, c.logprobs.tokens, c.logprobs.token_logprobs)
    scored = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == PROMPTS[0] and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs[:n_prompt]


def test_n_completions_and_seeds(client):
    def texts(seed, n=3):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=n, seed=seed)
        assert sorted(c.index for c in out.choices) == list(range(n))
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    first = texts(42)
    assert texts(42) == first  # reproducible
    assert len(set(first)) > 1  # the n completions differ
    assert texts(43) != first
    multi = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0).choices[0].text
    assert "." in full
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["."]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(".")]


def test_json_schema_output_validates(client):
    for messages in (chat("Give me a person as JSON."), chat("Who wrote Hamlet? Answer as JSON.")):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, temperature=0.7, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = client.chat.completions.create(model=MODEL, messages=chat("Reply with a JSON object with the key \"answer\": what is 2+2?"),
                                           max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    out = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert out.choices[0].text[:3].isdigit() and out.choices[0].text[3] == "-" and len(out.choices[0].text) == 8


def test_tools_go_to_the_chat_template():
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=256)
    llm.tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                                   "{% if tools %} Tools: {{ tools | map(attribute='function.name') | join(', ') }}{% endif %}")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with running_server(llm, "stories") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def prompt_tokens(**kw):
            return client.chat.completions.create(model="stories", messages=chat("Once upon a time"), max_tokens=1,
                                                  **kw).usage.prompt_tokens
        plain = prompt_tokens()
        with_tools = prompt_tokens(tools=[tool])
        expected = llm.tokenizer.encode("Once upon a time Tools: get_weather")
        assert with_tools == len(expected) > plain
        assert prompt_tokens(tools=[tool], tool_choice="none") == plain


def test_metrics_report_the_engine_and_the_requests(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0)
    text = requests.get(f"{server[0]}/metrics", timeout=10).text
    values = {line.split(" ")[0].split("{")[0]: float(line.split(" ")[-1])
              for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("ferrum:num_requests_running", "ferrum:num_requests_waiting", "ferrum:kv_cache_usage_perc",
                 "ferrum:prefix_cache_hit_rate"):
        assert name in values
    assert values["ferrum:prompt_tokens_total"] > 0 and values["ferrum:generation_tokens_total"] >= 5
    assert values["ferrum:time_to_first_token_seconds_count"] >= 1
    assert values["ferrum:inter_token_latency_seconds_count"] >= 4
    assert values["ferrum:e2e_request_latency_seconds_count"] >= 1
    assert values["ferrum:request_success_total"] >= 1
    assert "ferrum:lora_" not in text  # per-adapter counters only where LoRA is enabled


LONG_PROMPT = "word " * 600
BAD_REQUESTS = [
    # (path, body (bytes: sent as is), status)
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"max_tokens": 5}, 400),  # no prompt
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),  # nothing to do without echo
    ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 70}, 400),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"not-an-id": 1}}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400),  # longer than the context
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400),  # prompt + completion too long
    ("/v1/completions", {"prompt": [1, 99999999]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(", "json": {}}}, 400),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "response_format": {"type": "json_schema"}}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "response_format": {"type": "xml"}}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "top_logprobs": 2}, 400),  # without logprobs
    ("/v1/chat/completions", {"messages": chat("x"), "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "chat_template_kwargs": {"messages": 1}}, 400),
    ("/v1/chat/completions", {"messages": chat("x"), "model": "gpt-4"}, 404),
    ("/tokenize", {"prompt": "x", "messages": chat("x")}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/v1/no-such-route", {}, 404),
]


@pytest.mark.parametrize("path, body, status", BAD_REQUESTS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_its_4xx_in_openai_shape(server, path, body, status):
    url, engine = server
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = requests.post(url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    wait_until(lambda: pool_is_empty(engine), what="no request left behind")


def test_a_client_leaving_a_whole_reply_aborts_its_request(server):
    url, engine = server

    def aborted():
        text = requests.get(f"{url}/metrics", timeout=10).text
        found = re.search(r'ferrum:request_success_total\{finished_reason="abort",model_name="smollm2"\} (\S+)', text)
        return float(found.group(1)) if found else 0.0
    before = aborted()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(requests.Timeout):  # the client gives up and closes the connection
        requests.post(f"{url}/v1/completions", json=body, timeout=(10, 0.5))
    wait_until(lambda: aborted() == before + 1, what="the request aborted")
    wait_until(lambda: pool_is_empty(engine), what="its blocks freed")


def test_the_server_keeps_serving_after_bad_input(client):
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0).choices[0].text


def test_api_key_is_required_when_set():
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=128)
    with running_server(llm, "stories", api_key="sesame") as (url, _):
        body = {"model": "stories", "prompt": "Once", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model="stories", prompt="Once", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_full_waiting_queue_answers_503_and_frees_up():
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=256, max_num_seqs=1)
    with running_server(llm, "stories", max_waiting_requests=1) as (url, engine):
        body = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line).startswith(b"data: ")  # it runs: the batch is full
            with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as waiting:
                wait_until(lambda: engine.stats()["waiting_requests"] == 1, what="a waiting request")
                r = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
                assert r.status_code == 503 and r.json()["error"]["code"] == 503
                assert b"[DONE]" in b"".join(waiting.iter_lines())
            assert b"[DONE]" in b"".join(lines)
        r = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        wait_until(lambda: pool_is_empty(engine), what="an empty pool")


def test_a_request_bigger_than_the_kv_cache_is_a_400_and_a_cut_reply_says_why():
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=256, kv_cache_tokens=32)
    with running_server(llm, "stories") as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="cannot fit after a prompt of .* the KV cache holds 32 tokens"):
                r = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=200, stream=stream)
                list(r) if stream else r
        # No max_tokens: the reply runs until the cache is full, and says so.
        r = requests.post(f"{url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time",
                                                         "max_tokens": None, "ignore_eos": True}, timeout=60).json()
        assert (r["choices"][0]["finish_reason"], r["choices"][0]["length_limit"]) == ("length", "kv_cache")
        r = requests.post(f"{url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time",
                                                         "max_tokens": 3, "ignore_eos": True}, timeout=60).json()
        assert (r["choices"][0]["finish_reason"], r["choices"][0]["length_limit"]) == ("length", "max_tokens")
        wait_until(lambda: pool_is_empty(engine), what="the pool to empty")
