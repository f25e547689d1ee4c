"""The server's edges: CORS (none by default; the allowed origins' preflights answered), the API
key on every route but /health and /metrics, /health 503 once the engine stops, and the request
fields of other servers honoured (vLLM's guided_*, llama.cpp's grammar / json_schema, best_of)
or refused with a 400 naming them. A real server on 127.0.0.1, a generated tiny Qwen3-shape model."""
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

import ferrum
from server_harness import running_server

MODEL = "qwen3-tiny"
ORIGIN = "http://localhost:3000"
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "y": {"enum": ["up", "down"]}},
         "required": ["x", "y"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    return ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=256)


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm, MODEL, allowed_origins=[ORIGIN]) as (url, engine):
        yield url, engine


def preflight(url, origin):
    return requests.options(f"{url}/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_lets_in_the_allowed_origins_only(server, llm):
    url, _ = server
    ok = preflight(url, ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in preflight(url, "http://evil.example").headers
    r = requests.get(f"{url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    with running_server(llm, MODEL) as (plain, _):  # by default no origin is let in
        assert "access-control-allow-origin" not in preflight(plain, ORIGIN).headers
        r = requests.get(f"{plain}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_the_api_key_guards_every_route_but_health_metrics_and_the_chat_page(llm):
    with running_server(llm, MODEL, api_key="sesame", allowed_origins=["*"]) as (url, _):
        routes = [("post", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                  ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                  ("post", "/v1/embeddings", {"input": "x"}), ("post", "/v1/responses", {"input": "x"}),
                  ("get", "/v1/responses/resp_x", None), ("get", "/v1/models", None),
                  ("post", "/tokenize", {"prompt": "x"}), ("post", "/detokenize", {"tokens": [1]}),
                  ("get", "/tokenizer_info", None), ("get", "/openapi.json", None), ("get", "/docs", None),
                  ("get", "/no/such/route", None), ("get", "/ui/no-such-file", None)]
        for method, path, body in routes:
            r = requests.request(method, f"{url}{path}", json=body, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            r = requests.request(method, f"{url}{path}", json=body, headers={"Authorization": "Bearer sesame"},
                                 timeout=60)
            assert r.status_code != 401, path
        for path in ("/health", "/metrics", "/", "/ui/chat.js", "/ui/markdown.js", "/ui/chat.css"):
            assert requests.get(f"{url}{path}", timeout=10).status_code == 200, path
        assert preflight(url, ORIGIN).status_code == 200  # a browser's preflight carries no key


def test_health_is_503_once_the_engine_stops(llm):
    with running_server(llm, MODEL) as (url, engine):
        assert requests.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        engine.shutdown()
        r = requests.get(f"{url}/health", timeout=10)
        assert r.status_code == 503
        r = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503


def test_other_servers_constraint_fields_are_honoured(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "A point?"}], max_tokens=40, temperature=1.0)
    for seed in range(3):
        # The same constraint as structured_outputs' (this random model pads JSON with whitespace
        # until max_tokens, which JSON allows: the outputs are compared, not parsed).
        want = client.chat.completions.create(seed=seed, extra_body={"structured_outputs": {"json": POINT}},
                                              **chat).choices[0].message.content
        assert want.startswith("{") and want != client.chat.completions.create(seed=seed, **chat).choices[0].message.content
        for name in ("guided_json", "json_schema"):
            assert client.chat.completions.create(seed=seed, extra_body={name: POINT}, **chat).choices[0].message.content == want
        out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, seed=seed,
                                        extra_body={"guided_choice": ["red", "green", "blue"]})
        assert out.choices[0].text in ("red", "green", "blue")
        out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=10, seed=seed,
                                        extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"})
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", out.choices[0].text)
        for name in ("guided_grammar", "grammar"):
            out = client.completions.create(model=MODEL, prompt="Say:", max_tokens=10, seed=seed,
                                            extra_body={name: 'root ::= "yes" | "no" | "maybe"'})
            assert out.choices[0].text in ("yes", "no", "maybe")


def test_best_of_returns_the_most_likely_of_its_completions(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, logprobs=0)
    candidates = client.completions.create(n=4, **kw).choices  # the same four best_of samples
    best = max(candidates, key=lambda c: sum(c.logprobs.token_logprobs))
    got = client.completions.create(n=1, best_of=4, **kw).choices
    assert [c.text for c in got] == [best.text]


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
    ("/v1/chat/completions", {"guided_json": POINT, "response_format": {"type": "json_object"}}, "one constraint"),
    ("/v1/completions", {"guided_regex": "a", "grammar": 'root ::= "a"'}, "one constraint"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"best_of": 2, "n": 1, "stream": True, "temperature": 1}, "best_of"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/embeddings", {"pooling": "mean"}, "pooling"),
])
def test_fields_ferrum_does_not_honour_are_refused_by_name(server, path, body, words):
    base = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            "/v1/completions": {"prompt": "x", "max_tokens": 2}, "/v1/embeddings": {"input": "x"}}[path]
    r = requests.post(f"{server[0]}{path}", json={**base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_schemathesis_finds_no_server_error_in_the_agent_routes(qwen3_tiny, tmp_path):
    """Chat completions (tools, tool_choice, reasoning), embeddings and responses on a model whose
    template writes tool calls and reasoning: generated requests get answers or 4xx, never a 5xx."""
    llm = ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=64)  # bounds every generation
    with running_server(llm, MODEL) as (url, _):
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
             "--include-path-regex", "^/v1/(chat/completions|embeddings|responses)",
             "--checks", "not_a_server_error", "--max-examples", "25", "--max-time", "45", "--workers", "1",
             "--seed", "44", "--generation-database", "none", "--request-timeout", "60", "--no-color",
             "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert re.search(r"\d+ generated, \d+ passed", run.stdout), run.stdout[-2000:]
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
