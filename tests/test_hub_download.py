"""Hub ids download through huggingface_hub: HF_ENDPOINT points at a hub look-alike on loopback
(tests/hub_server.py) that serves generated models, never the internet. Each case runs in a
fresh interpreter because huggingface_hub reads HF_ENDPOINT once, at import."""
import json
import os
import socket
import subprocess
import sys

import pytest

import ferrum
from conftest import MODELS
from ferrum.tools.make_model import make_model
from hub_server import HubServer

TOK = f"{MODELS}/tokenizers/smollm2-135m-instruct"
PROMPT = [1, 17, 400, 9000, 23]
GREEDY = ferrum.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

LOAD_AND_GENERATE = """
import json, sys, ferrum
llm = ferrum.LLM(sys.argv[1], num_threads=1)
out = llm.generate(prompt_token_ids=[%r], sampling_params=ferrum.SamplingParams(
    max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"path": str(llm.model_path), "tokens": out[0].outputs[0].token_ids}))
""" % (PROMPT,)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    hf = make_model("llama", "tiny", "hf", "f32", seed=5, tokenizer=TOK, out=d / "hf")
    make_model("llama", "tiny", "gguf", "q8_0", seed=5, tokenizer=TOK, out=d / "gguf" / "tiny-q8_0.gguf")
    return {"ferrum-test/tiny-llama": hf, "ferrum-test/tiny-gguf": d / "gguf"}


def run_ferrum(model_id, endpoint, hf_home):
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, model_id], env=env,
                          capture_output=True, text=True, timeout=300)


def local_greedy(path):
    out = ferrum.LLM(str(path), num_threads=1).generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("model_id, local", [
    ("ferrum-test/tiny-llama", "ferrum-test/tiny-llama"),
    ("ferrum-test/tiny-gguf/tiny-q8_0.gguf", "ferrum-test/tiny-gguf"),
])
def test_hub_id_downloads_into_the_hub_cache_and_generates(repos, tmp_path, model_id, local):
    with HubServer(repos) as hub:
        r = run_ferrum(model_id, hub.url, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["path"].startswith(str(tmp_path / "hf"))  # huggingface_hub's cache, not a copy of ours
    assert any("/resolve/" in q for q in hub.requests)
    expected = repos[local] / "tiny-q8_0.gguf" if model_id.endswith(".gguf") else repos[local]
    assert got["tokens"] == local_greedy(expected)


def test_unknown_repo_is_a_clear_error(repos, tmp_path):
    with HubServer(repos) as hub:
        r = run_ferrum("ferrum-test/no-such-model", hub.url, tmp_path / "hf")
    assert r.returncode != 0
    assert "could not download 'ferrum-test/no-such-model'" in r.stderr
    assert "Traceback" in r.stderr and "Segmentation" not in r.stderr


def test_offline_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a loopback port with nothing listening: the machine is "offline"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_ferrum("ferrum-test/tiny-llama", f"http://127.0.0.1:{port}", tmp_path / "hf")
    assert r.returncode != 0
    assert "could not download 'ferrum-test/tiny-llama'" in r.stderr
    assert "Pass a local path when offline" in r.stderr
