"""Pipeline parallelism (docs/distributed.md): the aggregate tokens/s of concurrent requests on P
stages of one thread each against one process with P threads on the same work, the bytes each
stage boundary carries per token, and what the per-step costs predict for N machines.

usage: python bench/pp_bench.py [--model PATH] [--stages 2] [--requests 16] [-p 32] [-n 64] [-r 2]
                                [--data-dir ~/.cache/ferrum-bench] [--link NAME:LATENCY_US:GBPS ...]
The default model is TinyLlama-1.1B's shape with random weights in Q4_K_M (tp_bench.py's, written
once into --data-dir). Each configuration runs in fresh processes (the stages under `mpirun
--oversubscribe --bind-to none -np P`), -r runs, the best printed (on a shared machine the least
disturbed one): --requests prompts of -p tokens (all different), -n greedy tokens each, generated
together; tokens/s is the generated tokens over the wall time of the generate() call. A
1-thread single process is measured too: its step time is what one machine computes.

The prediction for N machines of one stage each, N forwards in flight (each stage computes 1/N
of the layers for each of N micro-batches of requests / N sequences): a 1-thread process's step
costs a + b x rows (the weights it reads, and each row's compute), fitted to its step times at
--requests and --requests / P sequences (both measured); a round in which every request gains a
token then costs N micro-batches of (a + b x requests / N) / N each, plus per micro-batch N - 1
hand-offs of its hidden rows (a latency and rows x hidden x 4 bytes each) and its logits rows sent
back to rank 0 from the last stage (a latency and rows x vocab x 4 bytes), the link's time
overlapping no compute (the worst case).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tp_bench  # noqa: E402  (the model, the MPI environment)

LINKS = tp_bench.LINKS


def one_run(model, stages, threads, requests, prompt_tokens, new_tokens):
    """In the processes of one configuration: rank 0 returns its figures (the others never return)."""
    import ferrum
    llm = ferrum.LLM(model, num_threads=threads, pipeline_parallel_size=stages, kv_cache_tokens=4096,
                     max_num_seqs=requests)
    prompts = [[1] + [100 + (7 * r + i) % 30000 for i in range(prompt_tokens - 1)] for r in range(requests)]
    params = ferrum.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=ferrum.SamplingParams(max_tokens=2, temperature=0))
    before = llm.stats()
    t0 = time.time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.time() - t0
    after = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    computed = after["computed_tokens"] - before["computed_tokens"]
    steps = after["steps"] - before["steps"]
    cfg = llm.config
    return {"stages": stages, "threads": threads, "tokens_per_s": generated / wall, "wall_s": wall,
            "generated": generated,
            "steps": steps, "step_ms": 1e3 * wall / steps, "computed_tokens": computed,
            "hand_off_bytes_per_token": (after["hand_off_bytes"] - before["hand_off_bytes"]) / computed,
            "hand_off_ms_per_step": 1e3 * (after["hand_off_seconds"] - before["hand_off_seconds"]) / steps,
            "memory": llm.runner.rank_memory(), "hidden": cfg["hidden_size"], "layers": cfg["num_layers"],
            "vocab": cfg["vocab_size"], "requests": requests,
            "max_forwards_in_flight": after["max_forwards_in_flight"]}


def measure(args, stages, threads, requests):
    cmd = [sys.executable, os.path.abspath(__file__), "--run", args.model, "--stages", str(stages),
           "--threads", str(threads), "--requests", str(requests), "-p", str(args.p), "-n", str(args.n)]
    if stages > 1:
        cmd = tp_bench.MPIRUN + ["-np", str(stages)] + cmd
    out = subprocess.run(cmd, env=tp_bench.ENV, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_cost(full, part):
    """a, b of a 1-thread step costing a + b x rows (seconds), from its runs at two request counts."""
    b = (full["step_ms"] - part["step_ms"]) / 1e3 / (full["requests"] - part["requests"])
    return full["step_ms"] / 1e3 - b * full["requests"], b


def predict(full, part, link, machines):
    """Aggregate tokens/s of `machines` stages over a link (latency in us, Gbit/s), as many
    micro-batches in flight, and the link time per round."""
    name, latency_us, gbps = link.split(":")
    alpha, beta = float(latency_us) * 1e-6, float(gbps) * 1e9 / 8
    a, b = step_cost(full, part)
    rows = full["requests"] / machines  # a micro-batch's
    compute_s = a + b * rows  # N micro-batches, each (a + b x rows) / N on a stage (its 1/N of the layers)
    tokens = rows * full["computed_tokens"] / full["generated"]  # rows handed on per micro-batch step
    link_s = machines * ((machines - 1) * (alpha + tokens * full["hidden"] * 4 / beta)
                         + alpha + rows * full["vocab"] * 4 / beta)
    return name, full["requests"] / (compute_s + link_s), 1e3 * link_s


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("-p", type=int, default=32, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-r", type=int, default=2, help="runs per configuration (the best is printed)")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    ap.add_argument("--link", action="append", default=None, help="NAME:LATENCY_US:GBPS for the prediction")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # inside a configuration's processes
    args = ap.parse_args()
    if args.run:
        print(json.dumps(one_run(args.run, args.stages, args.threads, args.requests, args.p, args.n)), flush=True)
        return
    args.model = args.model or tp_bench.default_model(args.data_dir)
    P = args.stages
    part = max(1, args.requests // P)
    configs = {"1 process, 1 thread": (1, 1, args.requests), f"1 process, 1 thread, {part} requests": (1, 1, part),
               f"1 process, {P} threads": (1, P, args.requests), f"{P} stages, 1 thread each": (P, 1, args.requests)}
    results, load = {}, [loadavg()]
    for name, (stages, threads, requests) in configs.items():
        runs = [measure(args, stages, threads, requests) for _ in range(args.r)]
        results[name] = max(runs, key=lambda r: r["tokens_per_s"])
        load.append(loadavg())
    print(f"model {os.path.basename(args.model)}, {args.requests} requests of {args.p} + {args.n} tokens, "
          f"best of {args.r}; 1-minute load average {' -> '.join(load)} on {os.cpu_count()} cores")
    print("configuration                tok/s   step ms  hand-off B/token  hand-off ms/step  weights MB per rank")
    for name, r in results.items():
        weights = " ".join(f"{m['weight_bytes'] / 1e6:.0f}" for m in r["memory"])
        print(f"{name:27s}  {r['tokens_per_s']:6.1f}  {r['step_ms']:7.1f}  {r['hand_off_bytes_per_token']:16.0f}  "
              f"{r['hand_off_ms_per_step']:16.3f}  {weights}")
    pp, tp = results[f"{P} stages, 1 thread each"], results[f"1 process, {P} threads"]
    print(f"{P} stages / 1 process of {P} threads: {pp['tokens_per_s'] / tp['tokens_per_s']:.2f}x; "
          f"bytes per token per boundary: {pp['hand_off_bytes_per_token']:.0f} (hidden x 4 = {4 * pp['hidden']})")
    full, half = results["1 process, 1 thread"], results[f"1 process, 1 thread, {part} requests"]
    a, b = step_cost(full, half)
    print(f"a 1-thread step: {1e3 * a:.1f} ms + {1e3 * b:.2f} ms per row; in flight, most forwards at once: "
          f"{pp['max_forwards_in_flight']}")
    print(f"predicted for N machines, one stage each, N micro-batches in flight (1 machine: "
          f"{full['tokens_per_s']:.1f} tok/s):")
    for link in args.link or LINKS:
        row = [predict(full, half, link, n) for n in (2, 4, 8)]
        print(f"  {row[0][0]:18s} " + "  ".join(f"N={n}: {tps:6.1f} tok/s ({ms:.2f} ms link per round)"
                                               for n, (_, tps, ms) in zip((2, 4, 8), row)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
