"""lm-evaluation-harness on ferrum: the `ferrum` model answers lm_eval's three request kinds with
ferrum.eval's results on the same items. The tasks are local JSON files in tests/lm_eval_tasks/
(nothing is downloaded); `lm_eval --model ferrum` finds the model by name."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ferrum
from conftest import STORIES_FORMATS
from ferrum import eval as ferrum_eval

TASKS = Path(__file__).parent / "lm_eval_tasks"
CAPITALS = [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text().splitlines()]
TEXTS = [json.loads(line)["text"] for line in (TASKS / "texts.jsonl").read_text().splitlines()]
MC_PROMPT = "Q: What is the capital of {country}?\nA:"
GEN_PROMPT = "Q: What is the capital of Spain?\nA: Madrid\nQ: What is the capital of {country}?\nA:"


def offline_env(tmp):
    """What keeps lm_eval and datasets off the network, their caches in `tmp`."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "datasets"),
            "HF_HOME": str(tmp / "hf")}


@pytest.fixture(scope="module")
def results(smollm2, tmp_path_factory):
    """The three tasks run in-process by lm_eval on the session's SmolLM2, every sample logged."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in offline_env(tmp).items():
            mp.setenv(k, v)
        mp.chdir(TASKS)  # the tasks' data_files are relative
        import lm_eval
        from lm_eval.tasks import TaskManager
        from ferrum.lm_eval_model import FerrumLM
        return lm_eval.simple_evaluate(
            model=FerrumLM(llm=smollm2), tasks=["ferrum_capitals_mc", "ferrum_capitals_gen", "ferrum_texts_rolling"],
            task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_is_ferrum_eval_loglikelihood(results, smollm2):
    pairs = [(MC_PROMPT.format(**doc), " " + choice) for doc in CAPITALS for choice in doc["choices"]]
    want = ferrum_eval.loglikelihood(smollm2, pairs)
    got = [float(r[0][0]) for s in samples(results, "ferrum_capitals_mc") for r in s["resps"]]
    np.testing.assert_allclose(got, [r.logprob for r in want], rtol=0, atol=1e-4)
    greedy = [r[0][1] for s in samples(results, "ferrum_capitals_mc") for r in s["resps"]]
    assert greedy == [r.is_greedy for r in want]
    picks = np.argmax(np.reshape([r.logprob for r in want], (len(CAPITALS), 3)), axis=1)
    accuracy = np.mean([p == doc["answer"] for p, doc in zip(picks, CAPITALS)])
    assert results["results"]["ferrum_capitals_mc"]["acc,none"] == pytest.approx(accuracy)
    assert accuracy >= 5 / 6  # SmolLM2 knows its capitals: the harness scored real answers


def test_generation_is_ferrum_eval_exact_match(results, smollm2):
    want = ferrum_eval.exact_match(smollm2, [(GEN_PROMPT.format(**doc), doc["capital"]) for doc in CAPITALS],
                                   max_tokens=8, stop=("\n",))
    got = [s["resps"][0][0] for s in samples(results, "ferrum_capitals_gen")]
    assert got == [item.output for item in want.items]
    assert results["results"]["ferrum_capitals_gen"]["exact_match,none"] == pytest.approx(want.accuracy)
    assert want.accuracy >= 5 / 6


def test_rolling_loglikelihood_is_ferrum_eval_perplexity(results, smollm2):
    tok = smollm2.tokenizer
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    want = [-ferrum_eval.perplexity(smollm2, [prefix] + tok.encode(t, add_special_tokens=False)).nll for t in TEXTS]
    got = [float(s["resps"][0][0]) for s in samples(results, "ferrum_texts_rolling")]
    assert got == want
    words = sum(len(t.split()) for t in TEXTS)
    assert results["results"]["ferrum_texts_rolling"]["word_perplexity,none"] == pytest.approx(
        np.exp(-sum(want) / words), rel=1e-5)


def test_empty_contexts_and_long_texts(smollm2):
    """An empty context is the prefix token, as lm_eval's models make it; a text longer than the
    context length is scored in windows, each token once."""
    from ferrum.lm_eval_model import FerrumLM
    lm = FerrumLM(llm=smollm2)
    (got,) = lm.loglikelihood([SimpleNamespace(args=("", " Hello there"))])
    ids = smollm2.tokenizer.encode(" Hello there", add_special_tokens=False)
    (want,) = ferrum_eval.loglikelihood(smollm2, [([lm.prefix_token_id], ids)])
    assert got == (want.logprob, want.is_greedy)
    small = FerrumLM(llm=ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=1, max_model_len=32))
    text = " ".join(TEXTS * 3)
    ids = small._rolling_ids(text)
    assert len(ids) > 64
    (total,) = small.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert total == -ferrum_eval.perplexity(small.llm, ids, window=32).nll
    assert small.loglikelihood_rolling([SimpleNamespace(args=("",))]) == [0.0]
    (out,) = small.generate_until([SimpleNamespace(args=(text, {"until": ["\n"], "max_gen_toks": 4}))])
    end = small.llm.tokenizer.encode(text)[-28:]  # what fits before 4 more tokens
    assert out == small.llm.generate({"prompt_token_ids": end}, ferrum.SamplingParams(
        max_tokens=4, temperature=0, stop=["\n"]))[0].outputs[0].text


def test_lm_eval_command_finds_the_ferrum_model(tmp_path):
    model = STORIES_FORMATS["gguf"]
    args = ["--model", "ferrum", "--model_args", f"pretrained={model},device=cpu,num_threads=1",
            "--tasks", "ferrum_capitals_mc", "--include_path", ".", "--output_path", str(tmp_path / "out")]
    if sys.flags.no_site:  # scripts/dev_test.sh: site-packages' .pth hooks do not run, so run ours
        cmd = [sys.executable, "-S", "-c", "import _ferrum_lm_eval, runpy, sys; sys.argv[0] = 'lm_eval'; "
               "runpy.run_module('lm_eval', run_name='__main__')", *args]
    else:
        cmd = [sys.executable, "-m", "lm_eval", *args]
    r = subprocess.run(cmd, cwd=TASKS, env=dict(os.environ, **offline_env(tmp_path)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (result_file,) = (tmp_path / "out").glob("*/results_*.json")
    acc = json.loads(result_file.read_text())["results"]["ferrum_capitals_mc"]["acc,none"]
    llm = ferrum.LLM(model, num_threads=1)
    scores = ferrum_eval.loglikelihood(llm, [(MC_PROMPT.format(**d), " " + c) for d in CAPITALS for c in d["choices"]])
    picks = np.argmax(np.reshape([s.logprob for s in scores], (len(CAPITALS), 3)), axis=1)
    assert acc == pytest.approx(np.mean([p == d["answer"] for p, d in zip(picks, CAPITALS)]))
    assert "|ferrum_capitals_mc" in r.stdout


def test_import_ferrum_does_not_import_lm_eval():
    r = subprocess.run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c",
                        "import sys, ferrum; assert 'lm_eval' not in sys.modules, sorted(sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_importing_ferrums_model_keeps_lm_evals_own_models():
    # lm_eval fills its registry with its own models only while the registry is empty.
    r = subprocess.run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c",
                        "from ferrum.lm_eval_model import FerrumLM; from lm_eval.api.registry import get_model; "
                        "assert get_model('ferrum') is FerrumLM; get_model('local-completions')"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
