"""Tensor parallelism (docs/distributed.md): per-rank memory, decode tokens/s at 1 and N ranks,
the all-reduce time per token, and what those figures predict for N machines over a given link.

usage: python bench/tp_bench.py [--model PATH] [--ranks 1 2] [-p 32] [-n 64] [-r 3]
                                [--launch mpirun|spawn] [--data-dir ~/.cache/ferrum-bench]
                                [--link NAME:LATENCY_US:GBPS ...]
The default model is TinyLlama-1.1B's shape with random weights in Q4_K_M (written once into
--data-dir). Each rank count runs in fresh processes (`mpirun --oversubscribe --bind-to none -np N`,
or one process spawning its ranks), one thread per rank, -r runs; the best run is printed (on a shared
machine the least disturbed one). A run: a -p token prompt, then -n greedy tokens of one
sequence, timed from the first decode step; rank 0's all-reduces (count and time, waits for the
other ranks included) come from the runner's stats.

The prediction for N machines of one rank each: a decode step's compute is the 1-rank step's / N
(each rank reads 1/N of the weights), plus per step 2 * layers + 1 all-reduces of `hidden` f32
values (recursive doubling, as MPI sums messages this small: log2 N rounds of one latency and the
whole message each) and the gather of the logits on rank 0 ((N - 1) / N * vocab f32 values, one
latency).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
# Ranks not pinned to cores: on a machine others use too, a pinned rank waits whenever another
# process runs on its core, and every rank waits for it at the next all-reduce.
MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none"]
LINKS = ["10GbE:20:10", "100Gb-InfiniBand:2:100"]


def default_model(data_dir):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from ferrum.tools.make_model import make_model
    tok = os.path.join(HERE, "..", "..", "shared", "models", "tokenizers", "llama2", "tokenizer.model")
    path = os.path.join(os.path.expanduser(data_dir), "tinyllama-1.1b-q4_k_m.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        make_model("llama", "tinyllama-1.1b", "gguf", "q4_k_m", seed=0, tokenizer=tok, out=path + ".part")
        os.replace(path + ".part", path)
    return path


def one_run(model, ranks, prompt_tokens, new_tokens):
    """In the ranks' processes: rank 0 returns the run's figures (the others never return)."""
    import ferrum
    t0 = time.time()
    llm = ferrum.LLM(model, num_threads=1, tensor_parallel_size=ranks, kv_cache_tokens=1024)
    load_s = time.time() - t0
    prompt = [1] + list(range(100, 100 + prompt_tokens - 1))
    params = ferrum.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=ferrum.SamplingParams(max_tokens=2, temperature=0))
    rid = llm.add_request(prompt, params)
    tokens = 0
    t_first = None
    before = llm.stats()
    while llm.has_unfinished():
        for d in llm.step():
            if d.request_id == rid:
                tokens += sum(len(c.token_ids) for c in d.outputs)
        if t_first is None:  # the prompt's step (and first token) done: decode from here
            t_first, before, first_tokens = time.time(), llm.stats(), tokens
    decode_s = time.time() - t_first
    after = llm.stats()
    decoded = tokens - first_tokens
    cfg = llm.config
    return {"ranks": ranks, "load_s": load_s, "decode_tokens_per_s": decoded / decode_s,
            "all_reduces_per_token": (after["all_reduces"] - before["all_reduces"]) / decoded,
            "all_reduce_ms_per_token": 1e3 * (after["all_reduce_seconds"] - before["all_reduce_seconds"]) / decoded,
            "memory": llm.runner.rank_memory(), "hidden": cfg["hidden_size"], "layers": cfg["num_layers"],
            "vocab": cfg["vocab_size"]}


def probe_link(hidden, reps=2000):
    """In mpirun's ranks: microseconds per all-reduce of `hidden` f32 values, nothing else running."""
    import numpy as np
    from ferrum import _core
    group = _core.mpi_world(60.0)
    a = np.ones(hidden, dtype=np.float32)
    for _ in range(100):
        group.all_reduce_sum(a)
    t0 = time.perf_counter()
    for _ in range(reps):
        group.all_reduce_sum(a)
    us = (time.perf_counter() - t0) / reps * 1e6
    group.close()
    _core.mpi_finalize()
    return us


def measure(args, ranks):
    cmd = [sys.executable, os.path.abspath(__file__), "--run", args.model, "--ranks", str(ranks), "-p", str(args.p),
           "-n", str(args.n)]
    if ranks > 1 and args.launch == "mpirun":
        cmd = MPIRUN + ["-np", str(ranks)] + cmd
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def predict(one, link, ranks):
    """Decode tokens/s of `ranks` machines over a link (latency in us, Gbit/s)."""
    name, latency_us, gbps = link.split(":")
    alpha, beta = float(latency_us) * 1e-6, float(gbps) * 1e9 / 8
    compute = 1 / one["decode_tokens_per_s"] / ranks
    reduces = 2 * one["layers"] + 1
    reduce_s = reduces * math.ceil(math.log2(ranks)) * (alpha + one["hidden"] * 4 / beta)
    gather_s = alpha + (ranks - 1) / ranks * one["vocab"] * 4 / beta
    return name, 1 / (compute + reduce_s + gather_s), 1e3 * (reduce_s + gather_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-p", type=int, default=32, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="generated tokens")
    ap.add_argument("-r", type=int, default=3, help="runs per rank count (the best is printed)")
    ap.add_argument("--launch", choices=["mpirun", "spawn"], default="mpirun")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    ap.add_argument("--link", action="append", default=None, help="NAME:LATENCY_US:GBPS for the prediction")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # inside the ranks' processes
    ap.add_argument("--probe", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(one_run(args.run, args.ranks[0], args.p, args.n)), flush=True)
        return
    if args.probe:
        us = probe_link(args.probe)
        if os.environ.get("OMPI_COMM_WORLD_RANK") == "0":
            print(json.dumps({"all_reduce_us": us}), flush=True)
        return
    args.model = args.model or default_model(args.data_dir)
    results = {}
    for ranks in args.ranks:
        runs = [measure(args, ranks) for _ in range(args.r)]
        results[ranks] = max(runs, key=lambda r: r["decode_tokens_per_s"])
    print(f"model {os.path.basename(args.model)}, {args.launch}, 1 thread per rank, best of {args.r}")
    print("ranks  tok/s   all-reduces/tok  all-reduce ms/tok  weights MB per rank   RSS MB per rank")
    for ranks, r in results.items():
        weights = " ".join(f"{m['weight_bytes'] / 1e6:.0f}" for m in r["memory"])
        rss = " ".join(f"{m['rss_bytes'] / 1e6:.0f}" for m in r["memory"])
        print(f"{ranks:5d}  {r['decode_tokens_per_s']:6.2f}  {r['all_reduces_per_token']:15.1f}  "
              f"{r['all_reduce_ms_per_token']:17.3f}  {weights:>19}   {rss}")
    for ranks in (r for r in args.ranks if r > 1 and args.launch == "mpirun"):
        hidden = results[ranks]["hidden"]
        cmd = MPIRUN + ["-np", str(ranks), sys.executable, os.path.abspath(__file__), "--probe", str(hidden)]
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
        us = json.loads(out.stdout.strip().splitlines()[-1])["all_reduce_us"]
        per_token = us * results[ranks]["all_reduces_per_token"] / 1e3
        print(f"{ranks} ranks, all-reduce of {hidden} f32 alone (no model running): {us:.1f} us; "
              f"{per_token:.2f} ms per token of the step's all-reduce time, the rest is waiting for the slower rank")
    if 1 in results:
        print("predicted for N machines, one rank each (1-rank compute / N + all-reduces + logits gather):")
        for link in args.link or LINKS:
            row = [predict(results[1], link, n) for n in (2, 4, 8)]
            print(f"  {row[0][0]:18s} " + "  ".join(f"N={n}: {tps:6.2f} tok/s ({ms:.2f} ms link)"
                                                   for n, (_, tps, ms) in zip((2, 4, 8), row)))
    print(json.dumps({str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    main()
