"""Real clients against a real server: lm-evaluation-harness's local-completions model (its
log-likelihoods equal ferrum.eval.loglikelihood's), schemathesis fuzzing the OpenAPI schema (no
500, the server alive afterwards), and `ferrum serve` itself, which exits 0 on SIGTERM."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

import ferrum
from ferrum.eval import loglikelihood
from server_harness import running_server, serve

TASK_DATA = Path(__file__).parent / "data" / "lm_eval_tiny.jsonl"


def test_lm_eval_loglikelihoods_equal_ferrum_eval(smollm2_path, smollm2, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = {"task": "ferrum_tiny", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(TASK_DATA)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    llm = ferrum.LLM(smollm2_path, num_threads=2, max_model_len=512)
    with running_server(llm, "smollm2") as (url, _):
        # The remote tokenizer backend tokenizes through the server's /tokenize: nothing is downloaded.
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task], log_samples=True, verbosity="WARNING",
            model_args=f"base_url={url}/v1/completions,model=smollm2,tokenizer_backend=remote,max_retries=1")
    samples = results["samples"]["ferrum_tiny"]
    pairs = [tuple(args) for s in samples for args in s["arguments"]]
    got = [tuple(r) for s in samples for r in s["filtered_resps"]]
    assert len(pairs) == 15

    # The server scores each prompt alone, every position: exactly ferrum's teacher-forced scores
    # of the same tokens (split as lm-eval splits them), summed in the same order.
    tok = smollm2.tokenizer
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        context_ids = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        scores = smollm2.token_logprobs(whole, start=1)
        assert logprob == sum(float(x) for x in scores.logprobs[len(context_ids) - 1:])
        assert greedy == bool(scores.greedy[len(context_ids) - 1:].all())

    # ferrum.eval scores all the pairs in shared forwards: a score's rows do not depend on what
    # shares its steps, so the same log-likelihoods (up to the order of the float64 sum).
    want = loglikelihood(smollm2, pairs)
    assert [g[1] for g in got] == [w.is_greedy for w in want]
    assert [g[0] for g in got] == pytest.approx([w.logprob for w in want], abs=1e-5)
    assert results["results"]["ferrum_tiny"]["acc,none"] >= 0.6  # the model knows most of these


def test_schemathesis_finds_no_server_error(smollm2_path, tmp_path):
    llm = ferrum.LLM(smollm2_path, num_threads=2, max_model_len=64)  # bounds every generation
    with running_server(llm, "smollm2") as (url, engine):
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
             "--checks", "not_a_server_error", "--max-examples", "10", "--max-time", "30", "--workers", "1",
             "--seed", "29", "--generation-database", "none", "--request-timeout", "60", "--no-color",
             "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=240, cwd=tmp_path)  # its caches go there
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert re.search(r"\d+ generated, \d+ passed", run.stdout), run.stdout[-2000:]
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        reply = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3


def test_ferrum_serve_exits_0_on_sigterm(smollm2_path):
    proc, url = serve(smollm2_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "smollm2"
        # The event loop (the main thread) runs only on cores the engine's threads leave idle.
        policies = {int(tid): thread_policy(proc.pid, tid) for tid in os.listdir(f"/proc/{proc.pid}/task")}
        assert policies.pop(proc.pid) == os.SCHED_IDLE
        assert os.SCHED_OTHER in policies.values()
        stream = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text is not None
        proc.send_signal(signal.SIGTERM)
        # The request in flight finishes, or is aborted after the grace period: the stream ends.
        reasons = [c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason]
        assert reasons in (["abort"], ["length"])
        assert proc.wait(timeout=60) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def thread_policy(pid, tid):
    """A thread's scheduling policy: field 41 of /proc/PID/task/TID/stat."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[38])
