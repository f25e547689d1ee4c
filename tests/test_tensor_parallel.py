"""Tensor parallelism over MPI (docs/distributed.md): 2 ranks under `mpirun --oversubscribe -np 2`
over TCP loopback, and ranks that LLM() spawns itself, against the single process.

Every process that joins MPI is a subprocess (tests/tp_ranks.py) with a timeout: MPI stays out of
the pytest process.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ferrum
import tp_ranks
from conftest import MODELS as SHARED_MODELS, STORIES, STORIES_FORMATS
from ferrum.tools.make_lora import make_lora
from ferrum.tools.make_model import make_model

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
STORIES_TOK = os.path.join(STORIES, "tok512.bin")
TOK = os.path.join(SHARED_MODELS, "tokenizers", "smollm2-135m-instruct")  # 49152 tokens
# Over TCP on the loopback interface, as ranks on separate machines talk; not pinned to cores (on a
# busy machine a pinned rank waits for its core, and the other rank for it).
MPI = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,tcp",
       "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
MPIRUN = MPI + ["-np", str(RANKS)]
# The collectives' deadline: a lost rank ends a test's processes well within its timeout.
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", FERRUM_TP_TIMEOUT="10",
           PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))

rng = np.random.default_rng(7)
PROMPTS = [[int(t) for t in rng.integers(3, 512, n)] for n in (5, 20, 37)]  # past the window, 2 KV blocks
INVARIANT_PROMPTS = [[1] + [int(t) for t in rng.integers(3, 512, rng.integers(1, 60))] for _ in range(8)]
SHARED_BASE = [1] + [int(t) for t in rng.integers(3, 512, 40)]
SHARED_PROMPTS = [SHARED_BASE + [7, 8, 9], SHARED_BASE + [10], SHARED_BASE[:33]]

# Tiny shapes that divide between 2 ranks (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128,
# 8 experts of 64 rows) with a vocabulary of 49160 rows, which the ranks share unevenly (24592 +
# 24568: whole groups of 16 rows on rank 0).
SHAPE = dict(num_layers=2, intermediate_size=128, vocab_size=49160)
MODELS = {
    "llama-hf": ("llama", "hf", "f32", {}),
    "llama-gguf-q8_0-untied": ("llama", "gguf", "q8_0", dict(tie_word_embeddings=False)),
    "llama-hf-one-kv-head": ("llama", "hf", "f32", dict(num_kv_heads=1)),  # shared by both ranks
    "qwen2-hf": ("qwen2", "hf", "f32", {}),
    "qwen2-gguf-q4_0": ("qwen2", "gguf", "q4_0", {}),
    "qwen3-hf": ("qwen3", "hf", "f32", {}),
    "qwen3-gguf-q4_k_m": ("qwen3", "gguf", "q4_k_m",  # k-quant shares of 256 columns, Q4_K + Q6_K parts
                          dict(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1024)),
    "mistral-hf-window": ("mistral", "hf", "f32", dict(sliding_window=8)),
    "mistral-gguf-f16-window": ("mistral", "gguf", "f16", dict(sliding_window=8)),
    "qwen3_moe-hf": ("qwen3_moe", "hf", "f32", dict(moe_intermediate_size=64, mlp_only_layers=(1,))),
    "qwen3_moe-gguf-q8_0": ("qwen3_moe", "gguf", "q8_0", dict(moe_intermediate_size=64)),
}


def write_model(d, arch, fmt, dtype, overrides):
    out = d / ("hf" if fmt == "hf" else f"{dtype}.gguf")
    return str(make_model(arch, "tiny", fmt, dtype, seed=5, out=out, **{**SHAPE, **overrides}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {name: write_model(tmp_path_factory.mktemp(name), *spec) for name, spec in MODELS.items()}
    return {name: {"name": name, "path": p, "tokenizer": TOK} for name, p in paths.items()}


@pytest.fixture(scope="module")
def refused_model(tmp_path_factory):
    """Q8_0 (blocks of 32) with an intermediate size of 96: down's shares of 48 columns are not
    whole blocks."""
    path = write_model(tmp_path_factory.mktemp("refused"), "llama", "gguf", "q8_0", dict(intermediate_size=96))
    return {"name": "refused", "path": path, "tokenizer": TOK}


def with_adapters(model, d):
    """`model` (HF) with two adapters PEFT makes for it: every projection at rank 8, in f32; q, v
    and down at ranks 4, 4 and 2 of its first and last layers, in bf16."""
    layers = json.loads((Path(model["path"]) / "config.json").read_text())["num_hidden_layers"]
    a = make_lora(model["path"], d / "a", r=8, lora_alpha=16, seed=1)
    b = make_lora(model["path"], d / "b", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                  rank_pattern={"down_proj": 2}, layers_to_transform=[0, layers - 1], seed=2, dtype="bfloat16")
    return dict(model, loras=[str(a), str(b)])


@pytest.fixture(scope="module")
def lora_model(models, tmp_path_factory):
    return with_adapters(models["llama-hf"], tmp_path_factory.mktemp("lora"))


STORIES_MODEL = {"name": "stories260K", "path": STORIES_FORMATS["gguf"]}
STORIES_OPENCL = dict(STORIES_MODEL, name="stories260K-opencl", device="opencl")  # a sum through host memory
EXTRA_MODELS = {m["name"]: m for m in (STORIES_MODEL, STORIES_OPENCL)}


def run_ranks(args, timeout, spawn=False):
    cmd = ([sys.executable] if spawn else MPIRUN + [sys.executable]) + [os.path.join(HERE, "tp_ranks.py")] + args
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def compared(models, refused_model, lora_model, tmp_path_factory):
    """One mpirun job: every model's results under 2 ranks, the engine invariants, LoRA adapters."""
    d = tmp_path_factory.mktemp("compare")
    spec = {"ranks": RANKS, "prompts": PROMPTS, "models": list(models.values()) + list(EXTRA_MODELS.values()),
            "refused": [refused_model],
            "invariants_model": STORIES_MODEL, "invariant_prompts": INVARIANT_PROMPTS,
            "shared_prompts": SHARED_PROMPTS, "lora_model": lora_model}
    (d / "spec.json").write_text(json.dumps(spec))
    run_ranks(["compare", str(d / "spec.json"), str(d / "out.npz")], timeout=600)
    return dict(np.load(d / "out.npz"))


def relative_error(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


# Generation steps over quantized weights quantize their activations to 8 bits: the ranks' partial
# sums round differently from one process's whole sums (in the last bit), and that can move an
# activation to the neighbouring int8 level, about 1% of the largest logit for a level (one
# 37-token prompt of the Q4_K_M model shows it under FERRUM_CPU_ISA=avx2; other prompts natively).
# Their scored logits (f32 activations) keep 1e-5; a lost shard or all-reduce is off by far more.
INT8_LEVEL = 5e-2


@pytest.mark.parametrize("name", list(MODELS) + list(EXTRA_MODELS))
def test_two_ranks_equal_one_process(name, models, compared):
    """Logits at every position (scored: f32 activations) within 1e-5 of the single process's,
    relative to the largest, and of generation steps (the decode path) too where its activations
    stay f32, within INT8_LEVEL where quantized weights take 8-bit ones; greedy tokens identical."""
    model = models.get(name) or EXTRA_MODELS[name]
    want = tp_ranks.model_results(tp_ranks.make_llm(model, 1), PROMPTS)
    int8_acts = name in MODELS and MODELS[name][2].startswith("q")
    for key, w in want.items():
        got = compared[f"{name}/{key}"]
        assert got.shape == w.shape, key
        if key == "greedy":
            assert got.tolist() == w.tolist()
        else:
            assert relative_error(got, w) <= (INT8_LEVEL if key == "generation" and int8_acts else 1e-5), key
    # the embedding, then o and the MLP of each layer: summed over the ranks
    assert compared[f"{name}/all_reduces"] > 0


def test_split_that_is_not_whole_blocks_is_refused_and_the_ranks_go_on(compared):
    message = str(compared["refused/refused"])
    assert "ffn_down" in message and "q8_0" in message and "shares of 48 columns" in message
    # the models after it loaded and ran on both ranks: test_two_ranks_equal_one_process


def test_engine_invariants_hold_under_tensor_parallelism(compared):
    inv = {k.split("/", 1)[1]: v for k, v in compared.items() if k.startswith("invariants/")}
    single = tp_ranks.make_llm(STORIES_MODEL, 1, enable_prefix_caching=False)
    alone = [tp_ranks.greedy(single, [p])[0] for p in INVARIANT_PROMPTS]
    assert inv["alone"].tolist() == alone
    assert inv["batch"].tolist() == alone  # batched == alone
    assert inv["chunked"].tolist() == alone  # chunked prefill == one shot
    miss = inv["prefix_miss"].tolist()
    assert miss == tp_ranks.greedy(single, SHARED_PROMPTS)
    assert inv["prefix_first"].tolist() == miss and inv["prefix_hit"].tolist() == miss  # hit == miss
    assert inv["prefix_hit_tokens"] > 0 and inv["blocks_used_after"] == 0


def assert_lora_equal_to_one_process(got, model, tp, pp):
    """tp_ranks.lora_results under `pp` stages of `tp` ranks against one process: scored logits
    within 1e-5, greedy tokens identical, under each adapter, the base and other request scales; a
    batch of two adapters and the base gives each prompt what it gets alone, bit for bit; every rank
    holds its share of each adapter, and frees it once rank 0 removes the adapter."""
    want = tp_ranks.lora_results(model, 1, 1, PROMPTS)
    got = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith("lora/")}
    for key, w in want.items():
        if key.startswith("held"):
            continue
        assert got[key].shape == w.shape, key
        if "greedy" in key:
            assert got[key].tolist() == w.tolist(), key
        else:
            assert relative_error(got[key], w) <= 1e-5, key
    last = len(PROMPTS) - 1
    for name, other in (("a", "base"), ("b", "base"), ("a_half", "a"), ("a_negative", "base")):
        assert relative_error(want[f"score_{name}{last}"], want[f"score_{other}{last}"]) > 1e-3, name  # they matter
    for i in range(len(PROMPTS)):
        alone = tp_ranks.LORA_MIXED[i % len(tp_ranks.LORA_MIXED)]
        assert np.array_equal(got[f"mixed_score{i}"], got[f"score_{alone}{i}"]), i
        assert got["mixed_greedy"][i].tolist() == got[f"greedy_{alone}"][i].tolist(), i
    whole = want["held"][0, 1]  # both adapters' bytes in one process
    held = got["held"]
    assert want["held"][0, 0] == 2 and held.shape == (tp * pp, 2) and (held[:, 0] == 2).all()
    assert (held[:, 1] > 0).all() and (held[:, 1] < whole).all()
    if tp == 1:  # each layer's updates on one stage
        assert held[:, 1].sum() == whole
    assert want["held_removed"].tolist() == [[0, 0]] and (got["held_removed"] == 0).all()
    assert (got["held_again"][:, 0] == 1).all()  # loaded again on every rank
    assert np.array_equal(got["score_a_again"], got["score_a0"])


def test_lora_adapters_under_tensor_parallelism(lora_model, compared):
    assert_lora_equal_to_one_process(compared, lora_model, RANKS, 1)


def test_cli_generate_under_mpirun_equals_one_process():
    args = [sys.executable, "-m", "ferrum", "generate", "Once upon a time", "-m", STORIES_FORMATS["gguf"],
            "-n", "24", "-t", "1"]
    one = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=120)
    two = subprocess.run(MPIRUN + args + ["--tensor-parallel-size", "2"], env=ENV, capture_output=True, text=True,
                         timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and len(one.stdout) > 40


def test_tensor_parallel_size_must_match_mpirun():
    code = "import ferrum; ferrum.LLM(%r, tensor_parallel_size=3)" % STORIES_FORMATS["gguf"]
    p = subprocess.run(MPIRUN + [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "mpirun started 2 ranks, but tensor_parallel_size is 3" in p.stderr


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True])
def test_bad_tensor_parallel_size(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ferrum.LLM(STORIES_FORMATS["gguf"], tensor_parallel_size=size)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~220 MB of f32 weights (tied), for memory: each rank should hold about half."""
    path = make_model("qwen3", "tiny", "hf", "f32", seed=1, out=tmp_path_factory.mktemp("big") / "hf",
                      hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=64,
                      intermediate_size=2816, vocab_size=8192)
    return {"name": "big", "path": str(path), "tokenizer": STORIES_TOK}


@pytest.fixture(scope="module")
def spawned(models, refused_model, big_model, tmp_path_factory):
    """LLM(tensor_parallel_size=2) in a plain process: it starts its rank 1 itself."""
    d = tmp_path_factory.mktemp("spawn")
    spec = {"ranks": RANKS, "model": STORIES_MODEL, "refused": refused_model,
            "prompts": INVARIANT_PROMPTS, "big_model": big_model}
    (d / "spec.json").write_text(json.dumps(spec))
    run_ranks(["spawn", str(d / "spec.json"), str(d / "out.json")], timeout=300, spawn=True)
    return json.loads((d / "out.json").read_text())


def test_spawned_ranks_equal_one_process(spawned):
    assert "shares of 48 columns" in spawned["refused"]  # and the next LLM spawned its ranks anew
    single = tp_ranks.make_llm(STORIES_MODEL, 1, enable_prefix_caching=False)
    assert spawned["greedy"] == [tp_ranks.greedy(single, [p])[0] for p in INVARIANT_PROMPTS]
    assert len(spawned["memory"]) == RANKS and len({m["pid"] for m in spawned["memory"]}) == RANKS


def test_prompt_embeds_under_tensor_parallelism(spawned):
    """Rows of the embedding given as prompts, mixed with an id prompt in one batch: the logits
    of the ids, bit for bit, with both ranks reading the rows from rank 0's plan."""
    assert spawned["embeds_score_equal"] == [True, True, True]


def test_each_rank_holds_half_the_weights(big_model, spawned):
    single = tp_ranks.make_llm(big_model, 1)
    whole = single.runner.rank_memory()[0]
    cfg = single.config
    h, layers = cfg["hidden_size"], cfg["num_layers"]
    # whole on every rank: the norms (2 per layer, the final one, q/k norms), and the 16 zero
    # rows after each rank's share of the embedding
    replicated = 4 * (h * (2 * layers + 1) + 2 * cfg["head_dim"] * layers)
    half = (whole["weight_bytes"] - replicated) / 2
    for rank in spawned["big_memory"]:
        assert half + replicated <= rank["weight_bytes"] <= half + replicated + 16 * h * 4
        # resident memory the load added: about half the single process's (its weights, packed)
        assert rank["load_rss_bytes"] < 0.55 * whole["load_rss_bytes"]
    assert whole["load_rss_bytes"] > 0.9 * whole["weight_bytes"]


def wait_for_line(p, key, timeout):
    end = time.time() + timeout
    while time.time() < end:
        line = p.stdout.readline()
        if line.startswith("{") and key in line:
            return json.loads(line)
    raise AssertionError(f"no {key!r} from the ranks")


def start_generating(spawn, ranks=RANKS, pp=1):
    """Ranks generating (`pp` stages of `ranks` tensor-parallel ranks), mid-generation: the process
    (mpirun's, or rank 0's that spawns the others) and the ranks' pids."""
    spec = {"ranks": ranks, "pp": pp, "model": STORIES_MODEL}
    path = os.path.join(HERE, f".mpi-generate-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.join(HERE, "tp_ranks.py"), "generate", path]
    p = subprocess.Popen(cmd if spawn else MPI + ["-np", str(ranks * pp)] + cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        pids = wait_for_line(p, "pids", 120)["pids"]
        time.sleep(1.0)  # mid-generation
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    finally:
        os.unlink(path)
    return p, pids


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def gone_within(pid, seconds):
    """Whether the process has ended within `seconds` (a killed process's teardown takes a
    moment after its job has returned, longer on a loaded machine)."""
    end = time.time() + seconds
    while alive(pid) and time.time() < end:
        time.sleep(0.05)
    return not alive(pid)


def finish(p, timeout):
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_killed_rank_ends_the_mpirun_job():
    p, pids = start_generating(spawn=False)
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)
    out, err = finish(p, timeout=60)
    assert p.returncode != 0 and time.time() - killed < 60
    assert gone_within(pids[0], 5)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_lost_spawned_rank_is_an_error_on_rank_0(how):
    """A spawned rank that exits is noticed at once; one that hangs (stopped), at the deadline
    (FERRUM_TP_TIMEOUT=10): rank 0's call raises RuntimeError and the rank is ended."""
    p, pids = start_generating(spawn=True)
    lost = time.time()
    os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    first = wait_for_line(p, "error", 60)
    again = wait_for_line(p, "again", 10)
    out, err = finish(p, timeout=30)
    assert p.returncode == 3
    if how == "killed":
        assert f"rank 1 (pid {pids[1]}) exited" in first["error"] and first["at"] - lost < 5
    else:
        assert "no rank answered" in first["error"] and "within 10 s" in first["error"]
        assert 10 <= first["at"] - lost < 30
    assert "the group is ended" in again["again"]
    time.sleep(0.5)
    assert not alive(pids[1])


def test_spawned_rank_ends_with_its_rank_0():
    p, pids = start_generating(spawn=True)
    os.kill(pids[0], signal.SIGKILL)
    finish(p, timeout=30)
    end = time.time() + 10
    while alive(pids[1]) and time.time() < end:
        time.sleep(0.1)
    assert not alive(pids[1])
