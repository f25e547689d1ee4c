"""Loading reports progress layer by layer; LLM shows it as a tqdm bar for large models."""
import pytest

import ferrum
import ferrum.llm
from conftest import STORIES_FORMATS
from ferrum import _core

STORIES = STORIES_FORMATS["gguf"]


@pytest.mark.parametrize("fmt", list(STORIES_FORMATS))
def test_runner_reports_every_layer_in_order(fmt):
    calls = []
    runner = _core.ModelRunner(STORIES_FORMATS[fmt], progress=lambda done, total: calls.append((done, total)))
    layers = runner.config["num_layers"]
    assert calls == [(i, layers) for i in range(1, layers + 1)]


def test_an_exception_in_the_callback_propagates_and_loading_still_works():
    def fail(done, total):
        raise KeyError("stop at layer %d" % done)
    with pytest.raises(KeyError, match="stop at layer 1"):
        _core.ModelRunner(STORIES, progress=fail)
    assert _core.ModelRunner(STORIES).config["num_layers"] > 0


def test_large_models_show_a_progress_bar(monkeypatch, capsys):
    monkeypatch.setattr(ferrum.llm, "PROGRESS_MIN_BYTES", 0)
    ferrum.LLM(STORIES, num_threads=1)
    err = capsys.readouterr().err
    layers = _core.ModelRunner(STORIES).config["num_layers"]
    assert "loading stories260K.gguf" in err and f"{layers}/{layers}" in err


def test_small_models_load_quietly(capsys):
    ferrum.LLM(STORIES, num_threads=1)
    assert "loading" not in capsys.readouterr().err
