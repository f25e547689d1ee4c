"""The pytest plugin: the example suite evals/ passes on SmolLM2, options reach the fixtures,
and a failing evaluation fails the run. Each run is a fresh pytest process, as a user runs it."""
import os
import subprocess
import sys
import textwrap

from conftest import STORIES_FORMATS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def run_pytest(args, cwd=ROOT):
    # -p loads the plugin whether or not ferrum's pytest11 entry point is installed yet (its name
    # is the module's, so the two never load it twice). -S is passed on when this process runs
    # without site-packages (scripts/dev_test.sh), so the child imports the same ferrum.
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "pytest", "-p", "ferrum.pytest_plugin",
           "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)


def test_example_eval_suite_passes_on_smollm2(smollm2_path):
    proc = run_pytest(["--ferrum-model", smollm2_path, "--ferrum-threads", "2", "evals/"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    assert f"ferrum: model {smollm2_path}, device cpu, threads 2, kv f16" in proc.stdout


SUITE = '''
import ferrum
from ferrum.eval import perplexity as plain_perplexity

def test_options_reach_the_model(ferrum_llm):
    assert str(ferrum_llm.model_path) == {model!r}
    assert ferrum_llm.runner.device == "cpu"

def test_fixtures_are_bound_to_the_session_model(ferrum_llm, perplexity, loglikelihood, exact_match):
    text = "Once upon a time, there was a little girl named Lily."
    assert perplexity(text, window=8, stride=4) == plain_perplexity(ferrum_llm, text, window=8, stride=4)
    (ll,) = loglikelihood([("Once upon a time", " there")])
    assert ll.num_tokens >= 1 and ll.logprob < 0
    assert len(exact_match([("Once upon a time", "zebra")], max_tokens=2).items) == 1

def test_a_perplexity_bound_that_fails(perplexity):
    assert perplexity("Once upon a time, there was a little girl.").perplexity < 1.0
'''


def test_options_and_fixtures_on_a_small_model(tmp_path):
    model = STORIES_FORMATS["gguf"]
    (tmp_path / "test_small.py").write_text(textwrap.dedent(SUITE.format(model=model)))
    proc = run_pytest(["--ferrum-model", model, "--ferrum-threads", "1", "--ferrum-kv-dtype", "f32",
                       str(tmp_path / "test_small.py")], cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]  # 1: some tests failed
    assert "2 passed" in out and "1 failed" in out, out[-4000:]
    assert "test_a_perplexity_bound_that_fails" in out
    assert f"ferrum: model {model}, device cpu, threads 1, kv f32" in out


def test_a_bad_model_path_errors_in_the_fixture(tmp_path):
    (tmp_path / "test_bad.py").write_text("def test_uses_model(ferrum_llm):\n    pass\n")
    proc = run_pytest(["--ferrum-model", str(tmp_path / "missing.gguf"), str(tmp_path / "test_bad.py")],
                      cwd=tmp_path)
    assert proc.returncode == 1
    assert "1 error" in proc.stdout and "no model at" in proc.stdout


def test_the_pyproject_entry_point_loads_the_plugin_once(tmp_path):
    """A distribution carrying pyproject.toml's pytest11 entry point (as an install writes it)
    loads the plugin by itself, and together with -p without registering it twice."""
    import tomllib
    entry = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["entry-points"]["pytest11"]
    dist = tmp_path / "site" / "ferrum_plugin_probe-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ferrum-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    (tmp_path / "test_probe.py").write_text("def test_plugin_options_exist(pytestconfig):\n"
                                            "    assert pytestconfig.getoption('ferrum_device') == 'cpu'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "pytest", "-p", "no:cacheprovider"]
    for extra in ([], ["-p", "ferrum.pytest_plugin"]):
        proc = subprocess.run([*base, *extra, "test_probe.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "1 passed" in proc.stdout and "ferrum: model default" in proc.stdout
    # With no entry points loaded and no -p the option does not exist: the probe is not vacuous.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run([*base, "test_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "no option named 'ferrum_device'" in proc.stdout


REPORTED = '''
import pytest

@pytest.fixture(scope="module")
def answers(exact_match):
    return exact_match([("Once upon a time", "zebra"), ("The cat sat", ["dog", "mat"])], max_tokens=4)

def test_answers_from_a_fixture(answers):
    assert answers.accuracy == 1.0

def test_evaluations_run_here(exact_match, loglikelihood, perplexity):
    loglikelihood([("Once upon a time", " there"), ("Once upon a time", " zebra")])
    perplexity("Once upon a time, there was a little girl.")
    assert exact_match([("Lily went to the", "park")], max_tokens=4).accuracy == 1.0

def test_that_passes(perplexity):
    assert perplexity("Once upon a time, there was a cat.").perplexity > 1
'''


def test_failures_show_the_items_and_the_report_has_them_all(tmp_path):
    import json
    import ferrum
    from ferrum import eval as ferrum_eval
    model = STORIES_FORMATS["gguf"]
    (tmp_path / "test_reported.py").write_text(REPORTED)
    report = tmp_path / "report.json"
    proc = run_pytest(["--ferrum-model", model, "--ferrum-threads", "1", "--ferrum-report", str(report),
                       str(tmp_path / "test_reported.py")], cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1 and "2 failed, 1 passed" in out, out[-4000:] + proc.stderr[-2000:]
    sections = out.split("- ferrum evaluation -")
    assert len(sections) == 3  # one table section per failed test, none for the passing one
    fixture_table, here_table = sections[1], sections[2]
    assert "exact_match: accuracy 0.0000, num_correct 0, num_items 2" in fixture_table
    assert "prompt" in fixture_table and "expected" in fixture_table and "output" in fixture_table
    assert "['dog', 'mat']" in fixture_table and "The cat sat" in fixture_table
    assert "loglikelihood: num_items 2" in here_table and "perplexity: perplexity" in here_table
    assert "Lily went to the" in here_table and "['park']" in here_table

    got = json.loads(report.read_text())
    assert got["model"] == model and got["threads"] == 1
    kinds = [(e["test"].split("::")[-1], e["kind"]) for e in got["evaluations"]]
    assert kinds == [("test_answers_from_a_fixture", "exact_match"), ("test_evaluations_run_here", "loglikelihood"),
                     ("test_evaluations_run_here", "perplexity"), ("test_evaluations_run_here", "exact_match"),
                     ("test_that_passes", "perplexity")]
    llm = ferrum.LLM(model, num_threads=1)
    want = ferrum_eval.exact_match(llm, [("Once upon a time", "zebra"), ("The cat sat", ["dog", "mat"])], max_tokens=4)
    assert got["evaluations"][0]["items"] == [
        {"prompt": i.prompt, "expected": i.expected, "output": i.output, "correct": i.correct} for i in want.items]
    assert got["evaluations"][0]["metrics"] == {"accuracy": want.accuracy, "num_correct": 0, "num_items": 2}
    ll = got["evaluations"][1]
    assert [i["continuation"] for i in ll["items"]] == [" there", " zebra"]
    pairs = [("Once upon a time", " there"), ("Once upon a time", " zebra")]
    assert [i["logprob"] for i in ll["items"]] == [r.logprob for r in ferrum_eval.loglikelihood(llm, pairs)]
    ppl = got["evaluations"][2]
    assert ppl["metrics"]["perplexity"] == ferrum_eval.perplexity(llm, "Once upon a time, there was a little girl.").perplexity
