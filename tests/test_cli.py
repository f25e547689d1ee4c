"""The `ferrum` command line (run as `python -m ferrum`, what the console script calls):
its output must be what the Python API gives for the same model and parameters."""
import json
import subprocess
import sys

import pytest

import ferrum
from conftest import STORIES_FORMATS

STORIES = STORIES_FORMATS["gguf"]
GREEDY = ferrum.SamplingParams(max_tokens=24, temperature=0)


def ferrum_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ferrum", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["bench"]])
def test_help(sub):
    r = ferrum_cli(*sub, "--help")
    assert r.returncode == 0
    assert r.stdout.startswith("usage: ferrum")
    for word in {"generate": ["--temperature", "--model", "prompt"], "chat": ["--system", "history"],
                 "bench": ["--n-prompt", "--n-gen"]}.get(sub[0] if sub else "", ["generate", "chat", "bench"]):
        assert word in r.stdout


def test_generate_prints_what_the_api_generates():
    r = ferrum_cli("generate", "Once upon a time", "-m", STORIES, "-n", "24", "--temperature", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    expected = ferrum.LLM(STORIES, num_threads=1).generate("Once upon a time", GREEDY)[0].outputs[0].text
    assert r.stdout == expected + "\n"


def test_interactive_chat_keeps_history(smollm2_path, smollm2):
    turns = ["My name is Ada. Say hello to me.", "What is my name?"]
    r = ferrum_cli("chat", "-m", smollm2_path, "-n", "16", "--temperature", "0", "-t", "2",
                   stdin="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    history, replies = [], []
    for text in turns:  # the same conversation through the API, each reply fed back
        history.append({"role": "user", "content": text})
        reply = smollm2.chat(history, ferrum.SamplingParams(max_tokens=16, temperature=0)).outputs[0].text
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
    assert r.stdout == "".join(f"> {reply}\n" for reply in replies) + "> \n"


def test_chat_without_template_is_a_clear_error():
    r = ferrum_cli("chat", "hello", "-m", STORIES, "-n", "4")
    assert r.returncode == 2
    assert r.stderr.startswith("ferrum: error:") and "chat template" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "-m", "/no/such/model.gguf"], "no model at"),
    (["generate", "hi", "-m", STORIES, "--temperature", "-1"], "temperature"),
    (["generate", "hi", "-m", STORIES, "--top-p", "0"], "top_p"),
    (["generate", "hi", "-m", STORIES, "--kv-dtype", "f8"], "invalid choice"),
])
def test_bad_arguments_are_clear_errors(args, message):
    r = ferrum_cli(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_bench_json():
    r = ferrum_cli("bench", STORIES, "-p", "32", "-n", "8", "-r", "1", "-t", "1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n_prompt"] == 32 and res["n_gen"] == 8
    for key in ["pp_tok_s", "tg_tok_s", "peak_rss_mib", "encode_us_per_tok", "decode_us_per_tok"]:
        assert res[key] > 0, key
    assert 0 < res["encode_vs_pp"] < 1 and 0 < res["decode_vs_tg"] < 1
