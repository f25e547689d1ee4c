"""/v1/embeddings through the `openai` client: equal to LLM.embed on the same inputs (texts,
token ids; float and base64), usage, and its 400s. A real server on 127.0.0.1, a generated
tiny Qwen3-shape model."""
import base64

import numpy as np
import openai
import pytest
import requests

import ferrum
from server_harness import pool_is_empty, running_server, wait_until

MODEL = "qwen3-tiny"
TEXTS = ["Hello world", "The capital of France is Paris.", "def f(x):\n    return x", "Ünïcödé and emoji 🦀"]


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    llm = ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=256)
    with running_server(llm, MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def reference(qwen3_tiny):
    return ferrum.LLM(qwen3_tiny, num_threads=2, max_model_len=256)


def test_embeddings_equal_llm_embed(server, reference):
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    want = [o.outputs.embedding for o in reference.embed(TEXTS)]
    ids = [reference.tokenizer.encode(t) for t in TEXTS]
    for fmt in ("float", "base64"):
        got = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in got.data] == list(range(len(TEXTS)))
        vectors = [d.embedding if fmt == "float" else
                   np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in got.data]
        assert vectors == want
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    # the client's default asks for base64 and decodes it
    assert client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding == want[0]
    assert [d.embedding for d in client.embeddings.create(model=MODEL, input=ids).data] == want
    assert client.embeddings.create(model=MODEL, input=ids[1]).data[0].embedding == want[1]
    raw = requests.post(f"{url}/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}, timeout=60)
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == want[2] and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    hidden = len(want[0])
    assert client.embeddings.create(model=MODEL, input="x", dimensions=hidden).data[0].embedding
    wait_until(lambda: pool_is_empty(engine), what="the KV pool to empty")


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "prompt"),
    ({"input": [1, 10 ** 9]}, "prompt"),
    ({"input": "word " * 300}, "prompt"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({}, "input"),
])
def test_bad_embedding_requests_get_400(server, body, param):
    r = requests.post(f"{server[0]}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
