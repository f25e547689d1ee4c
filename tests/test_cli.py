"""The `ferrum` command line (run as `python -m ferrum`, what the console script calls):
its output must be what the Python API gives for the same model and parameters."""
import json
import os
import subprocess
import sys

import pexpect
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


def test_version():
    r = ferrum_cli("--version")
    assert r.returncode == 0 and r.stdout == f"ferrum {ferrum.__version__}\n"


def test_generate_reads_the_prompt_from_stdin():
    r = ferrum_cli("generate", "-m", STORIES, "-n", "24", "--temperature", "0", "-t", "1", stdin="Once upon a time\n")
    assert r.returncode == 0, r.stderr
    expected = ferrum.LLM(STORIES, num_threads=1).generate("Once upon a time", GREEDY)[0].outputs[0].text
    assert r.stdout == expected + "\n"
    r = ferrum_cli("generate", "-m", STORIES, stdin="")
    assert r.returncode == 2 and "empty" in r.stderr


def test_speculative_config_reaches_the_engine():
    """Greedy speculation produces what plain greedy decoding does; a bad config is a clear error."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    plain = ferrum_cli("generate", "Once upon a time", "-m", STORIES, "-n", "24", "--temperature", "0", "-t", "1")
    fast = ferrum_cli("generate", "Once upon a time", "-m", STORIES, "-n", "24", "--temperature", "0", "-t", "1",
                      "--speculative-config", spec)
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout
    bad = ferrum_cli("generate", "hi", "-m", STORIES, "--speculative-config", "{nope")
    assert bad.returncode == 2 and "speculative_config is not valid JSON" in bad.stderr


def test_one_shot_chat_prints_only_the_reply(smollm2_path, smollm2):
    r = ferrum_cli("chat", "What is the capital of France?", "-m", smollm2_path, "-n", "16", "--temperature", "0",
                   "-t", "2")
    assert r.returncode == 0, r.stderr
    reply = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                         ferrum.SamplingParams(max_tokens=16, temperature=0)).outputs[0].text
    assert r.stdout == reply + "\n"


def test_every_command_takes_the_model_and_threads_alike():
    for sub in ("generate", "chat", "bench"):
        out = " ".join(ferrum_cli(sub, "--help").stdout.split())
        assert "--model MODEL, -m MODEL" in out and "--threads THREADS, -t THREADS CPU threads (default: all cores)" in out
    by_flag = ferrum_cli("bench", "-m", STORIES, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "--json")
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["model"] == STORIES
    twice = ferrum_cli("bench", STORIES, "-m", STORIES)
    assert twice.returncode == 2 and "give the model once" in twice.stderr


def test_bench_reports_mean_and_sd_next_to_the_best():
    r = ferrum_cli("bench", STORIES, "-p", "32", "-n", "8", "-r", "3", "-t", "1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for test in ("pp", "tg"):
        assert res[f"{test}_tok_s"] >= res[f"{test}_tok_s_mean"] > 0 and res[f"{test}_tok_s_sd"] >= 0
    assert res["repetitions"] == 3


# ---- the terminal: `ferrum chat` and `ferrum bench` in a pseudo-terminal -------------------------

def spawn(*args, home):
    env = dict(os.environ, FERRUM_HOME=str(home), TERM="dumb")
    return pexpect.spawn(sys.executable, ["-m", "ferrum", *args], env=env, encoding="utf-8", timeout=120,
                         dimensions=(50, 500))


def saved(child, path):
    child.sendline(f"/save {path}")
    child.expect(r"\(saved \d+ messages")
    child.expect("> ")
    return json.loads(path.read_text())


def test_chat_commands_in_a_terminal(tmp_path, smollm2_path, smollm2):
    child = spawn("chat", "-m", smollm2_path, "-n", "12", "--temperature", "0", "-t", "2", home=tmp_path)
    try:
        child.expect("> ")
        child.sendline("/system You answer in one word.")
        child.expect(r"\(system prompt set\)")
        child.expect("> ")
        child.sendline("Name a colour.")
        child.expect("> ")
        conversation = saved(child, tmp_path / "one.json")
        history = conversation[:2]
        assert history == [{"role": "system", "content": "You answer in one word."},
                           {"role": "user", "content": "Name a colour."}]
        reply = smollm2.chat(history, ferrum.SamplingParams(max_tokens=12, temperature=0)).outputs[0].text
        assert conversation[2] == {"role": "assistant", "content": reply}
        child.sendline("/reset")
        child.expect(r"\(conversation reset\)")
        child.expect("> ")
        assert saved(child, tmp_path / "two.json") == history[:1]
        child.sendline("/bogus")
        child.expect("unknown command '/bogus'")
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        child.wait()
        assert child.exitstatus == 0
        assert (tmp_path / "chat_history").read_text().count("/reset") == 1  # readline kept the session's lines
    finally:
        child.terminate(force=True)


def test_ctrl_c_stops_a_reply_and_keeps_the_conversation(tmp_path, smollm2_path, smollm2):
    child = spawn("chat", "-m", smollm2_path, "-n", "400", "--temperature", "0", "-t", "2", home=tmp_path)
    try:
        child.expect("> ")
        child.sendline("Tell me a very long story about a dragon.")
        child.expect(r"dragon\.\r\n")  # the terminal's echo of the line
        child.expect(r"\w")            # the reply has begun
        child.sendintr()
        child.expect(r"\[stopped\]")
        child.expect("> ")
        user, partial = saved(child, tmp_path / "cut.json")
        full = smollm2.chat([user], ferrum.SamplingParams(max_tokens=400, temperature=0)).outputs[0].text
        assert partial["role"] == "assistant" and partial["content"] and full.startswith(partial["content"])
        assert len(partial["content"]) < len(full)
        child.sendline("Thanks.")  # the conversation goes on, the cut reply in it
        child.expect("> ")
        conversation = saved(child, tmp_path / "after.json")
        assert conversation[:2] == [user, partial] and conversation[2] == {"role": "user", "content": "Thanks."}
        child.sendintr()  # at the prompt: a hint, then the second one quits
        child.expect("Ctrl-C again")
        child.sendintr()
        child.expect(pexpect.EOF)
        child.wait()
        assert child.exitstatus == 0
    finally:
        child.terminate(force=True)


def test_bench_shows_progress_in_a_terminal(tmp_path):
    child = spawn("bench", STORIES, "-p", "16", "-n", "4", "-r", "2", "-t", "1", home=tmp_path)
    try:
        child.expect("bench: run 1/2")
        child.expect("bench: run 2/2")
        child.expect(r"pp16: best [\d.]+ tok/s   mean [\d.]+ \+- [\d.]+ tok/s")
        child.expect(r"tg4: best [\d.]+ tok/s   mean [\d.]+ \+- [\d.]+ tok/s")
        child.expect(pexpect.EOF)
        child.wait()
        assert child.exitstatus == 0
    finally:
        child.terminate(force=True)
