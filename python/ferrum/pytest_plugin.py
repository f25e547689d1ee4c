"""pytest plugin: evaluate a model with ordinary pytest tests.

Registered through the ``pytest11`` entry point ``ferrum.pytest_plugin`` when ferrum is
installed (``-p ferrum.pytest_plugin`` loads it explicitly). Options:

  --ferrum-model PATH_OR_ID   model to load (default: SmolLM2-135M-Instruct Q4_1)
  --ferrum-device DEVICE      cpu or opencl[:platform[:device]] (default: cpu)
  --ferrum-threads N          CPU threads (default: all cores)
  --ferrum-kv-dtype DTYPE     f16 (default), f32 or int8

Fixtures (session-scoped, the model is loaded once): ``ferrum_llm`` (the ``ferrum.LLM``) and
``perplexity``, ``loglikelihood``, ``exact_match`` (the ``ferrum.eval`` functions with the
model bound). ferrum itself is imported only when a fixture is first used, so loading the
plugin costs nothing in projects that do not use it.
"""
from __future__ import annotations

import functools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("ferrum", "ferrum model evaluation")
    group.addoption("--ferrum-model", default=None, metavar="PATH_OR_ID",
                    help="model for the ferrum_llm fixture: directory, .gguf / llama2.c .bin file or "
                         "hub id (default: SmolLM2-135M-Instruct Q4_1)")
    group.addoption("--ferrum-device", default="cpu", metavar="DEVICE",
                    help="cpu or opencl[:platform[:device]] (default: cpu)")
    group.addoption("--ferrum-threads", type=int, default=None, metavar="N",
                    help="CPU threads (default: all cores)")
    group.addoption("--ferrum-kv-dtype", default="f16", choices=["f16", "f32", "int8"],
                    help="KV cache dtype (default: f16)")


def pytest_report_header(config):
    model = config.getoption("ferrum_model") or "default (SmolLM2-135M-Instruct Q4_1)"
    return (f"ferrum: model {model}, device {config.getoption('ferrum_device')}, "
            f"threads {config.getoption('ferrum_threads') or 'all'}, kv {config.getoption('ferrum_kv_dtype')}")


@pytest.fixture(scope="session")
def ferrum_llm(pytestconfig):
    """The model named by --ferrum-model, loaded once per test session."""
    import ferrum
    return ferrum.LLM(pytestconfig.getoption("ferrum_model"), device=pytestconfig.getoption("ferrum_device"),
                      num_threads=pytestconfig.getoption("ferrum_threads"),
                      kv_dtype=pytestconfig.getoption("ferrum_kv_dtype"))


@pytest.fixture(scope="session")
def perplexity(ferrum_llm):
    """``perplexity(text_or_ids, window=None, stride=None)`` on the session's model."""
    from ferrum import eval as ferrum_eval
    return functools.partial(ferrum_eval.perplexity, ferrum_llm)


@pytest.fixture(scope="session")
def loglikelihood(ferrum_llm):
    """``loglikelihood([(context, continuation), ...])`` on the session's model."""
    from ferrum import eval as ferrum_eval
    return functools.partial(ferrum_eval.loglikelihood, ferrum_llm)


@pytest.fixture(scope="session")
def exact_match(ferrum_llm):
    """``exact_match([(prompt, expected), ...], **options)`` on the session's model."""
    from ferrum import eval as ferrum_eval
    return functools.partial(ferrum_eval.exact_match, ferrum_llm)
