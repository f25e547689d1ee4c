"""Pipeline parallelism over MPI (docs/distributed.md): 2 stages under `mpirun --oversubscribe
-np 2`, and 2 stages of 2 tensor-parallel ranks each (-np 4), over TCP loopback, against the
single process; ranks that LLM() spawns itself for a lost rank.

Every process that joins MPI is a subprocess (tests/pp_ranks.py, tests/tp_ranks.py) with a
timeout: MPI stays out of the pytest process.
"""
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ferrum
import tp_ranks
from conftest import STORIES, STORIES_FORMATS
from ferrum.tools.make_model import make_model
from test_tensor_parallel import (ENV, HERE, INVARIANT_PROMPTS, MPI, PROMPTS, SHARED_PROMPTS,
                                  assert_lora_equal_to_one_process, finish, gone_within, relative_error,
                                  start_generating, wait_for_line, with_adapters)

STORIES_TOK = os.path.join(STORIES, "tok512.bin")

# 4 layers of the tiny shapes (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, 8 experts
# of 64 rows), which also divide between 2 tensor-parallel ranks.
SHAPE = dict(num_layers=4, vocab_size=512)
MODELS = {
    "llama-hf": ("llama", "hf", "f32", {}),
    "llama-gguf-q8_0-untied": ("llama", "gguf", "q8_0", dict(tie_word_embeddings=False)),
    "qwen2-hf": ("qwen2", "hf", "f32", {}),  # QKV bias
    "qwen3-hf": ("qwen3", "hf", "f32", {}),  # QK-norm
    "mistral-gguf-f16-window": ("mistral", "gguf", "f16", dict(sliding_window=8)),
    # layers 0 and 1 dense, 2 and 3 sparse: split by weight, the first stage takes 3 layers
    "qwen3_moe-hf": ("qwen3_moe", "hf", "f32", dict(moe_intermediate_size=64, mlp_only_layers=(0, 1))),
}
PARTITIONS = {"qwen3-hf": "1,3"}  # given, not the cheapest
STORIES_MODEL = {"name": "stories260K", "path": STORIES_FORMATS["gguf"]}  # 5 layers, tied embedding
STORIES_OPENCL = dict(STORIES_MODEL, name="stories260K-opencl", device="opencl")  # hand-offs through host memory
EXTRA_MODELS = {m["name"]: m for m in (STORIES_MODEL, STORIES_OPENCL)}


def write_model(d, arch, fmt, dtype, overrides):
    out = d / ("hf" if fmt == "hf" else f"{dtype}.gguf")
    return str(make_model(arch, "tiny", fmt, dtype, seed=5, out=out, **{**SHAPE, **overrides}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, spec in MODELS.items():
        out[name] = {"name": name, "path": write_model(tmp_path_factory.mktemp(name), *spec),
                     "tokenizer": STORIES_TOK, "partition": PARTITIONS.get(name), "embeds": name == "llama-hf"}
    return out


@pytest.fixture(scope="module")
def memory_model(tmp_path_factory):
    """Untied f32, its layers most of its weights: each stage should hold half of them."""
    path = make_model("llama", "tiny", "hf", "f32", seed=1, out=tmp_path_factory.mktemp("memory") / "hf",
                      hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768,
                      vocab_size=1024, tie_word_embeddings=False)
    return {"name": "memory", "path": str(path), "tokenizer": STORIES_TOK, "memory_only": True}


@pytest.fixture(scope="module")
def lora_model(models, tmp_path_factory):
    """The 4-layer Llama with two adapters (the second of layers 0 and 3: one on each stage)."""
    return with_adapters(models["llama-hf"], tmp_path_factory.mktemp("lora"))


REFUSED = ["2,2", "1,1,3", "5,0", "6,-1"]  # stories260K has 5 layers, 2 stages


def run_job(ranks, spec, d, timeout):
    (d / "spec.json").write_text(json.dumps(spec))
    cmd = MPI + ["-np", str(ranks), sys.executable, os.path.join(HERE, "pp_ranks.py"), "compare",
                 str(d / "spec.json"), str(d / "out.npz")]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(np.load(d / "out.npz"))


@pytest.fixture(scope="module")
def two_stages(models, memory_model, lora_model, tmp_path_factory):
    """One mpirun job of 2 ranks, 2 stages: refused partitions, every model, the invariants, LoRA
    adapters."""
    spec = {"tp": 1, "pp": 2, "prompts": PROMPTS, "refused": [[STORIES_MODEL, p] for p in REFUSED],
            "models": list(models.values()) + list(EXTRA_MODELS.values()) + [memory_model],
            "invariants_model": STORIES_MODEL, "invariant_prompts": INVARIANT_PROMPTS,
            "shared_prompts": SHARED_PROMPTS, "lora_model": lora_model}
    return run_job(2, spec, tmp_path_factory.mktemp("pp2"), timeout=600)


@pytest.fixture(scope="module")
def two_by_two(models, lora_model, tmp_path_factory):
    """4 ranks: 2 stages of 2 tensor-parallel ranks."""
    spec = {"tp": 2, "pp": 2, "prompts": PROMPTS, "refused": [],
            "models": [models[n] for n in ("llama-hf", "qwen2-hf", "qwen3-hf", "mistral-gguf-f16-window", "qwen3_moe-hf")]
            + [STORIES_MODEL],
            "invariants_model": STORIES_MODEL, "invariant_prompts": INVARIANT_PROMPTS[:4],
            "shared_prompts": SHARED_PROMPTS, "lora_model": lora_model}
    return run_job(4, spec, tmp_path_factory.mktemp("pp2tp2"), timeout=600)


def single_results(model):
    return tp_ranks.model_results(tp_ranks.make_llm(model, 1), PROMPTS)


def assert_equal_to_one_process(model, got):
    """Logits at every position (scored) and of generation steps within 1e-5 of the single
    process's, relative to the largest; greedy tokens identical."""
    for key, want in single_results(model).items():
        have = got[f"{model['name']}/{key}"]
        assert have.shape == want.shape, key
        if key == "greedy":
            assert have.tolist() == want.tolist()
        else:
            assert relative_error(have, want) <= 1e-5, key


@pytest.mark.parametrize("name", list(MODELS) + list(EXTRA_MODELS))
def test_two_stages_equal_one_process(name, models, two_stages):
    model = models.get(name) or EXTRA_MODELS[name]
    assert_equal_to_one_process(model, two_stages)
    assert two_stages[f"{name}/pipeline_parallel_size"] == 2 and two_stages[f"{name}/all_reduces"] == 0
    # the first stage sent its hidden rows on: f32 [tokens, hidden] per step
    hidden = tp_ranks.make_llm(model, 1).config["hidden_size"]
    sent, count = int(two_stages[f"{name}/hand_off_bytes"]), int(two_stages[f"{name}/hand_offs"])
    assert count > 0 and sent % (4 * hidden) == 0 and sent >= count * 4 * hidden


@pytest.mark.parametrize("got", ["two_stages", "two_by_two"])
def test_prompt_embeds_under_pipeline_parallelism(got, models, request):
    """The embedding's own rows give the ids' logits bit for bit on the first stage; a batch
    mixing them with id prompts generates as the ids do; every position's final hidden state
    comes back from the last stage as one process computes it."""
    got = request.getfixturevalue(got)
    model = models["llama-hf"]
    prompts = PROMPTS[:3]
    assert got["llama-hf/embeds_scores_equal"].all()
    assert got["llama-hf/embeds_greedy_mixed"].tolist() == got["llama-hf/embeds_greedy_ids"].tolist()
    assert got["llama-hf/embeds_greedy_ids"].tolist() == got["llama-hf/greedy"][:3].tolist()
    single = tp_ranks.make_llm(model, 1)
    for i, e in enumerate(single.embed([{"prompt_token_ids": p} for p in prompts[:2]], pooling="all", normalize=False)):
        assert relative_error(got[f"llama-hf/hidden{i}"], np.array(e.outputs.embedding, dtype=np.float32)) <= 1e-5


@pytest.mark.parametrize("name", ["llama-hf", "qwen2-hf", "qwen3-hf", "mistral-gguf-f16-window", "qwen3_moe-hf", "stories260K"])
def test_two_stages_of_two_tensor_parallel_ranks_equal_one_process(name, models, two_by_two):
    model = models.get(name, STORIES_MODEL)
    assert_equal_to_one_process(model, two_by_two)
    assert two_by_two[f"{name}/tensor_parallel_size"] == 2 and two_by_two[f"{name}/pipeline_parallel_size"] == 2
    assert two_by_two[f"{name}/all_reduces"] > 0
    stages = two_by_two[f"{name}/memory"][:, 0]
    assert stages.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("got", ["two_stages", "two_by_two"])
def test_lora_adapters_under_pipeline_parallelism(got, lora_model, request):
    tp = 1 if got == "two_stages" else 2
    assert_lora_equal_to_one_process(request.getfixturevalue(got), lora_model, tp, 2)


def layer_cost(cfg, layer):
    """A layer's parameters (an MoE layer's experts all counted)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    attention = h * hd * (cfg["num_heads"] * 2 + cfg["num_kv_heads"] * 2)
    if layer in cfg["moe_layers"]:
        return attention + cfg["num_experts"] * (3 * h * cfg["moe_intermediate_size"] + h)
    return attention + 3 * h * cfg["intermediate_size"]


def cheapest(cfg, stages=2):
    """Every split's costliest stage (the last with the lm_head), the least of them."""
    layers = cfg["num_layers"]
    costs = {}
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0,) + cuts + (layers,)
        stage_costs = [sum(layer_cost(cfg, l) for l in range(a, b)) for a, b in zip(bounds, bounds[1:])]
        stage_costs[-1] += cfg["hidden_size"] * cfg["vocab_size"]
        costs[tuple(b - a for a, b in zip(bounds, bounds[1:]))] = max(stage_costs)
    return min(costs.values()), costs


@pytest.mark.parametrize("name", list(MODELS) + ["stories260K"])
def test_layers_split_by_cost_or_as_given(name, models, two_stages):
    model = models.get(name, STORIES_MODEL)
    cfg = tp_ranks.make_llm(model, 1).config
    memory = two_stages[f"{name}/memory"]
    stage, layer0, layers, kv_bytes = memory[:, 0], memory[:, 1], memory[:, 2], memory[:, 4]
    assert stage.tolist() == [0, 1] and layer0.tolist() == [0, layers[0]] and layers.sum() == cfg["num_layers"]
    best, costs = cheapest(cfg)
    if name in PARTITIONS:
        assert ",".join(map(str, layers)) == PARTITIONS[name]
    else:
        assert costs[tuple(layers)] == best
    if name == "qwen3_moe-hf":
        assert layers.tolist() == [3, 1]  # by layers alone it would be 2 and 2
    # each stage's KV pool holds its own layers, of the same blocks
    assert kv_bytes[0] * layers[1] == kv_bytes[1] * layers[0]


def test_each_stage_holds_its_share_of_the_weights(memory_model, two_stages):
    whole = tp_ranks.make_llm(memory_model, 1).runner.rank_memory()[0]["weight_bytes"]
    stages = two_stages["memory/memory"]
    assert stages[:, 2].tolist() == [2, 2]
    weights = stages[:, 3]
    assert weights.sum() == whole  # each weight on one stage: the embedding on the first, lm_head on the last
    assert all(abs(w - whole / 2) <= 0.01 * whole for w in weights)


def test_bad_partitions_are_refused_and_the_ranks_go_on(two_stages):
    messages = [str(two_stages[f"refused{i}"]) for i in range(len(REFUSED))]
    assert "adds up to 4 layers, the model has 5" in messages[0]
    assert "has 3 counts for 2 stages" in messages[1]
    assert "gives a stage no layers" in messages[2] and "gives a stage no layers" in messages[3]
    assert all('pipeline layer partition "' in m for m in messages)
    # the models after them loaded and ran on both ranks: test_two_stages_equal_one_process


def test_engine_invariants_hold_under_pipeline_parallelism(two_stages, two_by_two):
    single = tp_ranks.make_llm(STORIES_MODEL, 1, enable_prefix_caching=False)
    alone = [tp_ranks.greedy(single, [p])[0] for p in INVARIANT_PROMPTS]
    shared = tp_ranks.greedy(single, SHARED_PROMPTS)
    for got, n in ((two_stages, len(INVARIANT_PROMPTS)), (two_by_two, 4)):
        inv = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith("invariants/")}
        assert inv["alone"].tolist() == alone[:n]
        assert inv["batch"].tolist() == alone[:n]  # batched == alone
        assert inv["chunked"].tolist() == alone[:n]  # chunked prefill == one shot
        assert inv["prefix_miss"].tolist() == shared
        assert inv["prefix_first"].tolist() == shared and inv["prefix_hit"].tolist() == shared  # hit == miss
        assert inv["prefix_hit_tokens"] > 0 and inv["blocks_used_after"] == 0
        assert inv["preempted"].tolist() == alone[:n] and inv["preemptions"] > 0  # preempted == uninterrupted
        assert inv["speculative"].tolist() == alone[:n] and inv["spec_proposed"] > 0  # verified == plain
        # one forward per stage in flight: while the second stage computes one, the first computes the next
        assert inv["max_forwards_in_flight"] == 2


def test_cli_generate_under_mpirun_equals_one_process():
    args = [sys.executable, "-m", "ferrum", "generate", "Once upon a time", "-m", STORIES_FORMATS["gguf"],
            "-n", "24", "-t", "1"]
    one = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=120)
    two = subprocess.run(MPI + ["-np", "2"] + args + ["--pipeline-parallel-size", "2"], env=ENV,
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and len(one.stdout) > 40


def test_rank_count_must_match_mpirun():
    code = "import ferrum; ferrum.LLM(%r, tensor_parallel_size=2, pipeline_parallel_size=2)" % STORIES_FORMATS["gguf"]
    p = subprocess.run(MPI + ["-np", "2", sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    assert "mpirun started 2 ranks, but tensor_parallel_size x pipeline_parallel_size is 2 x 2" in p.stderr


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True])
def test_bad_pipeline_parallel_size(size):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ferrum.LLM(STORIES_FORMATS["gguf"], pipeline_parallel_size=size)


@pytest.mark.parametrize("partition", ["3;2", "a,b", "", [3.0, 2], [True, 4]])
def test_partition_that_is_not_counts_is_refused(partition):
    with pytest.raises(ValueError, match="pipeline_layer_partition must be layer counts per stage"):
        ferrum.LLM(STORIES_FORMATS["gguf"], pipeline_parallel_size=2, pipeline_layer_partition=partition)


def test_partition_from_the_environment(monkeypatch):
    monkeypatch.setenv("FERRUM_PP_LAYER_PARTITION", "3,x")
    with pytest.raises(ValueError, match="FERRUM_PP_LAYER_PARTITION must be layer counts"):
        ferrum.LLM(STORIES_FORMATS["gguf"], pipeline_parallel_size=2)
    # one stage: the variable (for pipeline-parallel models) is not read; a partition given is checked
    with pytest.raises(ValueError, match='partition "3,2" has 2 counts for 1 stages'):
        ferrum.LLM(STORIES_FORMATS["gguf"], pipeline_layer_partition="3,2")


def test_killed_stage_is_an_error_on_rank_0():
    """The last stage, killed while rank 0 waits for its logits: rank 0's call raises
    RuntimeError at once and every later call too."""
    p, pids = start_generating(spawn=True, ranks=1, pp=2)
    lost = time.time()
    os.kill(pids[1], signal.SIGKILL)
    first = wait_for_line(p, "error", 60)
    again = wait_for_line(p, "again", 10)
    finish(p, timeout=30)
    assert p.returncode == 3
    assert f"rank 1 (pid {pids[1]}) exited" in first["error"] and first["at"] - lost < 5
    assert "the group is ended" in again["again"]


def test_killed_rank_ends_the_mpirun_job():
    p, pids = start_generating(spawn=False, ranks=2, pp=2)
    killed = time.time()
    os.kill(pids[3], signal.SIGKILL)
    finish(p, timeout=60)
    assert p.returncode != 0 and time.time() - killed < 60
    assert gone_within(pids[0], 5)
