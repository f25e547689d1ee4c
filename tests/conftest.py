import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
MODELS = os.path.join(SHARED, "models")


def backend_names():
    return ["cpu", "opencl"]


@pytest.fixture(scope="session", params=backend_names())
def backend(request):
    from ferrum import _core
    return _core.make_backend(request.param, 2)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


STORIES = os.path.join(MODELS, "stories260K")
STORIES_FORMATS = {
    "llama2c": os.path.join(STORIES, "stories260K.bin"),
    "gguf": os.path.join(STORIES, "stories260K.gguf"),
    "safetensors": os.path.join(STORIES, "hf-converted"),
}


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (fetched by setup through pip)."""
    from ferrum.models import default_model_path
    return str(default_model_path())


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    import ferrum
    return ferrum.LLM(smollm2_path, num_threads=2)


@pytest.fixture(scope="session")
def qwen3_tiny(tmp_path_factory):
    """A generated tiny Qwen3-shape model (random weights) with the real Qwen3-0.6B tokenizer and
    chat template (`<tool_call>`, `<think>`)."""
    from ferrum.tools.make_model import main as make_model
    out = tmp_path_factory.mktemp("qwen3-tiny")
    make_model(["--arch", "qwen3", "--preset", "tiny", "--tokenizer", os.path.join(MODELS, "tokenizers", "qwen3-0.6b"),
                "--out", str(out)])
    return str(out)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own model loaded from the same GGUF (dequantized to f32): loading it takes
    tens of seconds on 2 cores, so the suites that compare against it share one."""
    import torch
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)


def greedy_tokens(llm, prompt_ids, params):
    """The first completion's token ids of each prompt, generated together."""
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)]


def assert_pool_empty(llm):
    """Nothing runs or waits, and every KV block is free (full ones may stay cached)."""
    st = llm.stats()
    assert st["kv_blocks_used"] == 0 and st["sequences"] == 0 and st["running"] == 0 and st["waiting"] == 0


@pytest.fixture(scope="session")
def gpu_family_models(tmp_path_factory):
    """The small generated models scripts/gpu_family_workload.py runs."""
    import gpu_family_runs  # noqa: F401 (puts scripts/ on the path)
    import gpu_family_workload
    return gpu_family_workload.model_files(tmp_path_factory.mktemp("gpu_family_models"))


@pytest.fixture(scope="session")
def gpu_family_on_pocl(gpu_family_models, tmp_path_factory):
    """tuning name -> the folder of the workload's run on pocl at that tuning (made once)."""
    from gpu_family_runs import TUNINGS, run_workload
    runs = {}

    def run(name: str):
        if name not in runs:
            out = tmp_path_factory.mktemp(f"gpu_family_pocl_{name}")
            run_workload(out, gpu_family_models[0].parent, TUNINGS[name], simulator=False)
            runs[name] = out
        return runs[name]
    return run
